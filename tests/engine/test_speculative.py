"""Speculative decoding inside the batched step is exact: every request's tokens, text, finish
reason and logprobs equal ``Model.generate`` of it alone, whatever its drafts (right, wrong or
partly right), its neighbours, its stops, constraint, penalties, pool or cancellation.

The drafts come from an oracle source that proposes each request's true continuation (from
``Model.generate``) with random corruption, and random tokens past its end, so stops, EOS and
``max_tokens`` fall inside drafts.
"""

import json
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer.engine.speculation
from slotinfer.engine.engine import Engine
from slotinfer.kv import KV_BLOCK_SIZE, block_bytes
from slotinfer.spec import CostModel, Drafter, ForcedTokens
from test_properties import feed  # tests/ is on pytest's path: one way to run arrivals through an engine

FAMILIES = ["llama", "qwen3", "gemma2"]


class Oracle:
    """Proposes a row's true continuation, each token replaced at random with chance ``p``, and
    random tokens past the continuation's end."""

    name = "oracle"
    prior = (9.0, 0.1)  # open from the start

    def __init__(self, truth, p: float, rng: random.Random):
        self.truth = [(list(prompt), list(out)) for prompt, out in truth]
        self.p, self.rng = p, rng

    def propose(self, row, k):
        tokens = row.tokens
        for prompt, out in self.truth:
            if tokens[:len(prompt)] == prompt and tokens[len(prompt):] == out[:len(tokens) - len(prompt)]:
                done = len(tokens) - len(prompt)
                draft = out[done:done + k]
                draft += [self.rng.randrange(3, 500) for _ in range(k - len(draft))]
                return [self.rng.randrange(3, 500) if self.rng.random() < self.p else t for t in draft]
        return [self.rng.randrange(3, 500) for _ in range(self.rng.randrange(k + 1))]


def spec_engine(model, truth, *, p=0.2, k=4, seed=0, forced=False, **kw):
    engine = Engine(model, speculative="ngram", draft_tokens=k, **kw)
    sources = [ForcedTokens()] if forced else []
    engine.drafter = Drafter(sources=[*sources, Oracle(truth, p, random.Random(seed))],
                             cost=CostModel(position_cost=0.01, max_k=k))
    return engine


def ref(model, ids, params):
    """``Model.generate`` of a request (which takes no logprob parameters)."""
    return model.generate(ids, **{k: v for k, v in params.items() if k not in ("logprobs", "top_logprobs")})


def assert_same(got, want, off=None):
    """``got`` as ``want`` (``Model.generate``) and, for logprobs, as ``off`` (speculation off).

    Logprobs agree to float32 rounding, not bit for bit: a step of 8 rows or more multiplies in
    another (fixed) order than one of fewer (docs/blas.md), with speculation on or off, so a
    request's logits differ in their last bits between steps of different row counts.
    """
    assert got.tokens == want.tokens
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    if off is not None:
        assert off.tokens == want.tokens
        assert (got.logprobs is None) == (off.logprobs is None)
        if got.logprobs is not None:
            np.testing.assert_allclose(got.logprobs, off.logprobs, rtol=1e-4, atol=1e-5)
        assert (got.top_logprobs is None) == (off.top_logprobs is None)
        for a, b in zip(got.top_logprobs or (), off.top_logprobs or ()):
            np.testing.assert_allclose([v for _, v in a], [v for _, v in b], rtol=1e-4, atol=1e-5)
            gap = min((abs(x[1] - y[1]) for x, y in zip(b, b[1:])), default=1.0)
            if gap > 1e-4:  # no near tie: the same tokens in the same order
                assert [t for t, _ in a] == [t for t, _ in b]


def assert_pool_empty(engine):
    pool = engine.table.pool
    assert pool.num_used == 0 and not pool.tables.any() and not pool.held.any()
    assert engine.items.free == list(range(engine.slots)) and not any(engine.items.by_slot)


@st.composite
def requests(draw, model):
    out = []
    for _ in range(draw(st.integers(1, 5))):
        ids = draw(st.lists(st.integers(3, 500), min_size=1, max_size=30))
        params = dict(max_tokens=draw(st.integers(1, 16)), ignore_eos=draw(st.booleans()))
        if draw(st.booleans()):
            params.update(temperature=draw(st.sampled_from([0.7, 1.3])), top_k=draw(st.sampled_from([0, 5])),
                          top_p=draw(st.sampled_from([1.0, 0.9])), min_p=draw(st.sampled_from([0.0, 0.05])),
                          seed=draw(st.integers(0, 2**32 - 1)))
        if draw(st.booleans()):
            params["repetition_penalty"] = draw(st.sampled_from([1.3, 0.8]))
        if draw(st.booleans()):
            params.update(presence_penalty=draw(st.sampled_from([0.0, 0.5])),
                          frequency_penalty=draw(st.sampled_from([0.0, 0.7])))
        if draw(st.booleans()):
            params["logit_bias"] = draw(st.dictionaries(st.integers(3, 500), st.sampled_from([-5.0, 3.0]),
                                                        min_size=1, max_size=3))
        params["logprobs"] = draw(st.booleans())
        if params["logprobs"] and draw(st.booleans()):
            params["top_logprobs"] = draw(st.integers(1, 5))
        if draw(st.booleans()):  # a stop string from its own text: it ends inside a draft
            text = ref(model, ids, params).text
            if len(text) > 4:
                at = draw(st.integers(0, len(text) - 3))
                params["stop"] = [text[at:at + draw(st.integers(1, 3))]]
        out.append((draw(st.integers(0, 6)), ids, params))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data(), slots=st.integers(1, 5), k=st.integers(1, 6), p=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
       seed=st.integers(0, 2**16), prefill=st.sampled_from([8, 512]))
def test_outputs_equal_generate_whatever_the_drafts(models, family, data, slots, k, p, seed, prefill):
    """Greedy and seeded rows, penalties, logit_bias, stop strings, logprobs and top_logprobs, random
    arrivals: each request as ``Model.generate`` alone, every block back in the pool."""
    m = models[family]
    reqs = data.draw(requests(m))
    want = [ref(m, ids, params) for _, ids, params in reqs]
    off = feed(Engine(m, slots=slots, max_len=64, prefill_tokens=prefill), reqs)
    engine = spec_engine(m, [(m.encode_prompt(ids), w.tokens) for (_, ids, _), w in zip(reqs, want)], p=p, k=k,
                         seed=seed, slots=slots, max_len=64, prefill_tokens=prefill)
    handles = feed(engine, reqs)
    for h, w, o in zip(handles, want, off):
        assert_same(h.result(0), w, o.result(0))
    assert engine.items.finished == len(reqs)
    assert_pool_empty(engine)
    c = engine.counters
    assert c["spec_accepted"] <= c["spec_drafted"]
    if p == 0.0 and any(len(w.tokens) >= 6 for w in want):
        assert c["spec_accepted"] > 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}}, "required": ["name", "n"],
          "additionalProperties": False}


@pytest.mark.parametrize("kind,value", [("json_schema", SCHEMA), ("regex", r"(ab|cd)[0-9]{2,5}x"),
                                        ("choice", ["alpha beta", "gamma"])])
@given(p=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16), k=st.integers(1, 5))
def test_constrained_rows_take_only_what_their_grammar_allows(models, kind, value, p, seed, k):
    """Forced tokens and corrupted drafts (cut where the grammar refuses them) beside a free row:
    each output as alone, and a constrained one always parses."""
    m = models["llama"]
    reqs = [(0, [5, 6, 7, 8], {kind: value, "max_tokens": 24, "logprobs": True}),
            (1, [9, 10, 11], {"max_tokens": 10, "ignore_eos": True}),
            (2, [12, 13], {kind: value, "max_tokens": 24, "temperature": 1.0, "seed": seed})]
    want = [ref(m, ids, params) for _, ids, params in reqs]
    off = feed(Engine(m, slots=3, max_len=64), reqs)
    engine = spec_engine(m, [(m.encode_prompt(ids), w.tokens) for (_, ids, _), w in zip(reqs, want)], p=p, k=k,
                         seed=seed, forced=True, slots=3, max_len=64)
    handles = feed(engine, reqs)
    for h, w, o in zip(handles, want, off):
        assert_same(h.result(0), w, o.result(0))
    if kind == "json_schema":
        for i in (0, 2):
            if want[i].finish_reason == "stop":
                json.loads(handles[i].result(0).text)
    assert_pool_empty(engine)


@given(data=st.data(), slots=st.integers(1, 4), blocks=st.integers(2, 5), k=st.integers(1, 8),
       p=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 2**16))
def test_a_tight_pool_preempts_and_cancels_as_without_speculation(models, data, slots, blocks, k, p, seed):
    """A few blocks for several slots: drafts' extra blocks are given up first, then the newest row
    is preempted and resumed; cancellations land inside drafts.  Every request ends once, the
    uncancelled as alone, streams carry each token once, and every block goes back."""
    m = models["llama"]
    cfg = m.config
    each = block_bytes(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       dtype=mx.float32, block_size=KV_BLOCK_SIZE)
    room = blocks * KV_BLOCK_SIZE
    reqs = data.draw(st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(3, 500), min_size=1, max_size=200),
                                        st.integers(1, 40), st.sampled_from([{}, dict(temperature=0.9, seed=3)])),
                              min_size=1, max_size=5))
    reqs = [(a, ids, dict(max_tokens=n, ignore_eos=True, **s)) for a, ids, n, s in reqs if len(ids) + n - 1 <= room]
    cancels = data.draw(st.dictionaries(st.integers(0, 4), st.integers(0, 12), max_size=2))
    want = [m.generate(ids, **params) for _, ids, params in reqs]
    engine = spec_engine(m, [(m.encode_prompt(ids), w.tokens) for (_, ids, _), w in zip(reqs, want)], p=p, k=k,
                         seed=seed, slots=slots, max_len=600, prefill_tokens=64,
                         kv_cache_bytes=(blocks + 2) * each, prefix_cache_bytes=0)

    items = tracked(engine)

    def on_step(step, handles):
        for i, at in cancels.items():
            if at == step and i < len(handles) and handles[i] is not None:
                handles[i].cancel()
        pool = engine.table.pool
        for it in engine.items.by_slot:
            if it is not None:
                assert pool.held[it.slot] <= -(-it.reserved // KV_BLOCK_SIZE)
        assert all(it.draft is None for it in engine.items.waiting)  # preempted: its drafting state went

    handles = feed(engine, reqs, on_step=on_step)
    assert engine.items.finished == len(reqs)
    assert all(it.draft is None for it in items)  # every way of ending frees the drafting state
    for i, (h, w) in enumerate(zip(handles, want)):
        c = h.result(0)
        streamed = [e.token for e in h]
        assert streamed == c.tokens[:len(streamed)]
        if c.finish_reason == "cancelled":
            assert i in cancels
            assert c.tokens == w.tokens[:len(c.tokens)]
        else:
            assert c.tokens == w.tokens
    assert_pool_empty(engine)


def tracked(engine) -> list:
    """The items ``engine`` makes from now on, in order."""
    items, make = [], engine.make_item

    def make_item(*a, **kw):
        items.append(make(*a, **kw))
        return items[-1]

    engine.make_item = make_item
    return items


def test_a_request_that_ends_gives_its_drafting_state_up(models):
    """Ending by max_tokens, a stop string, cancellation or a failing callback, each request's
    drafting row goes, after the suffix pool has learned every token it took: a request with the
    same salt can then draft from the end of its output."""
    m = models["llama"]
    base = [17, 42, 99, 7, 31, 64, 5, 88]
    reqs = [(0, base * 4, dict(max_tokens=24, ignore_eos=True, cache_salt="a")),
            (0, base[::-1] * 3, dict(max_tokens=40, ignore_eos=True, cache_salt="b")),
            (1, [3, 4] * 10, dict(max_tokens=30, ignore_eos=True, cache_salt="c")),
            (2, [9, 10, 11] * 5, dict(max_tokens=30, ignore_eos=True, cache_salt="d"))]
    text = m.generate(reqs[1][1], max_tokens=40, ignore_eos=True).text
    reqs[1][2]["stop"] = [text[len(text) // 2:len(text) // 2 + 2]]

    def fail(ev):
        raise RuntimeError("a consumer's bug")

    engine = Engine(m, slots=4, max_len=128, speculative="ngram", draft_tokens=4)
    items = tracked(engine)
    handles = feed(engine, reqs[:3] + [(2, reqs[3][1], dict(reqs[3][2], on_token=fail))],
                   on_step=lambda step, hs: step == 5 and hs[2].cancel())
    reasons = []
    for it, h in zip(items, handles):
        reasons.append("error" if h._future.exception(0) else h.result(0).finish_reason)
        assert it.draft is None
        seq = it.prompt + it.tokens
        assert engine.drafter.pool.follow(seq[:-1], 1, it.salt) == seq[-1:]
    assert reasons == ["length", "stop", "cancelled", "error"]


def test_an_acceptance_check_that_lies_breaks_exactness(models, monkeypatch):
    """Accepting one draft token past the first miss: some output then differs from
    ``Model.generate``, so the properties above would catch it."""
    m = models["llama"]
    reqs = [(0, [5 + i, 6, 7, 8 + i], dict(max_tokens=16, ignore_eos=True)) for i in range(3)]
    want = [m.generate(ids, **params) for _, ids, params in reqs]
    truth = [(m.encode_prompt(ids), w.tokens) for (_, ids, _), w in zip(reqs, want)]
    honest = spec_engine(m, truth, p=0.3, k=4, seed=1, slots=3, max_len=64)
    assert [h.result(0).tokens for h in feed(honest, reqs)] == [w.tokens for w in want]
    real = slotinfer.engine.speculation.accepted
    monkeypatch.setattr(slotinfer.engine.speculation, "accepted", lambda sampled, drafts: min(len(drafts),
                                                                                       real(sampled, drafts) + 1))
    lying = spec_engine(m, truth, p=0.3, k=4, seed=1, slots=3, max_len=64)
    assert [h.result(0).tokens for h in feed(lying, reqs)] != [w.tokens for w in want]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gemma3"])
def test_batch_generate_with_ngram_drafts_equals_generate(models, family):
    """The engine's own drafter (prompt lookup, suffix pool): a prompt that repeats itself opens
    its gate, and the output is still ``Model.generate``'s."""
    m = models[family]
    base = [17, 42, 99, 7, 31, 64, 5, 88]
    prompts = [base * 4, (base[::-1]) * 3, [3, 4] * 10, [11]]
    refs = [m.generate(p, max_tokens=40, ignore_eos=True) for p in prompts]
    got = m.batch_generate(prompts, max_tokens=40, ignore_eos=True, slots=2, speculative="ngram", draft_tokens=6)
    assert [g.tokens for g in got] == [r.tokens for r in refs]
    assert [g.text for g in got] == [r.text for r in refs]


def test_stats_count_drafted_and_accepted_tokens(models):
    m = models["llama"]
    ids = [17, 42, 99, 7, 31, 64, 5, 88] * 4
    want = m.generate(ids, max_tokens=30, ignore_eos=True)
    engine = spec_engine(m, [(ids, want.tokens)], p=0.0, k=4, slots=1, max_len=128)
    feed(engine, [(0, ids, dict(max_tokens=30, ignore_eos=True))])
    s = engine.stats()
    assert s["spec_drafted"] > 0 and s["spec_accepted"] == s["spec_drafted"]  # a right oracle
    assert s["spec_tokens_per_pass"] > 1 and s["spec_acceptance"] == 1.0
    assert s["steps"] < 30
    assert s["decode_tokens"] == 29  # the first token comes from the prefill


def test_bad_options_are_refused(models):
    m = models["llama"]
    with pytest.raises(ValueError, match="speculative"):
        Engine(m, slots=1, max_len=16, speculative="eagle")
    with pytest.raises(ValueError, match="draft_tokens"):
        Engine(m, slots=1, max_len=16, speculative="ngram", draft_tokens=0)


def test_metrics_count_draft_tokens(models):
    """The server's /metrics exposition carries the drafted and accepted tokens since its start."""
    pytest.importorskip("prometheus_client")
    import slotinfer
    from slotinfer.serve.metrics import Metrics

    m = models["llama"]
    with slotinfer.Inferencer(m, slots=1, max_len=128, speculative="ngram", draft_tokens=4) as inf:
        metrics = Metrics(inf)
        inf.engine.drafter = Drafter(sources=[Oracle([([3, 4] * 8, [])], 1.0, random.Random(0))],
                                     cost=CostModel(position_cost=0.01, max_k=4))
        inf.generate([3, 4] * 8, max_tokens=20, ignore_eos=True)
        text = metrics.exposition()[0].decode()
        s = inf.stats()
    assert s["spec_drafted"] > 0
    assert f"slotinfer_spec_draft_tokens_total {float(s['spec_drafted'])}" in text
    assert f"slotinfer_spec_accepted_tokens_total {float(s['spec_accepted'])}" in text
