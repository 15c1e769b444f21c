"""The prefix cache: a hit gives the tokens of a cold run, is never served across salts or by a
hash collision, stays within its budget, and actually happens.

The engine properties run on tiny models of every family (Gemma's 16-token sliding window
included) with small blocks, so prompts of a few dozen tokens span several blocks.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer
from slotinfer.engine.engine import Engine
from slotinfer.kv import PrefixCache
from slotinfer.testing import FAMILIES
from test_properties import feed as _run

MAX_LEN = 96
BS = 4  # tokens a block holds in these tests


def _engine(model, slots, budget=None, prefill=16):
    return Engine(model, slots=slots, max_len=MAX_LEN, prefill_tokens=prefill,
                  prefix_cache_bytes=budget if budget is not None else 1 << 30, prefix_block_size=BS)


@st.composite
def shared_prefix_requests(draw):
    """Prompts drawn from a few shared prefixes, each with its own continuation; some repeated."""
    prefixes = draw(st.lists(st.lists(st.integers(3, 500), min_size=1, max_size=30), min_size=1, max_size=3))
    out = []
    for _ in range(draw(st.integers(2, 7))):
        if out and draw(st.booleans()):
            out.append((draw(st.integers(0, 12)), *out[draw(st.integers(0, len(out) - 1))][1:]))  # a repeat
            continue
        ids = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(3, 500), min_size=1, max_size=12))
        params = dict(max_tokens=draw(st.integers(1, 10)), ignore_eos=True)
        if draw(st.booleans()):
            params["cache_salt"] = draw(st.sampled_from(["a", "b"]))
        out.append((draw(st.integers(0, 12)), ids, params))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@given(reqs=shared_prefix_requests(), slots=st.integers(1, 4), budget_blocks=st.sampled_from([1, 3, 1000]))
def test_cache_hits_give_the_tokens_of_a_cold_run(models, family, reqs, slots, budget_blocks):
    m = models[family]
    engine = _engine(m, slots)
    cache = engine.prefix_cache
    cache.budget_bytes = budget_blocks * cache.block_bytes
    handles = _run(engine, reqs)
    for (_, ids, params), h in zip(reqs, handles):
        got = h.result(0)
        want = m.generate(ids, **{k: v for k, v in params.items() if k != "cache_salt"})
        assert got.tokens == want.tokens and got.text == want.text
        assert 0 <= got.cached_tokens < len(ids) and got.cached_tokens % BS == 0
    assert len(cache) <= budget_blocks and cache.nbytes <= cache.budget_bytes
    assert engine.items.free == list(range(slots)) and not engine.busy


def test_a_repeated_prompt_hits_and_is_token_exact(models):
    m = models["gemma3_text"]  # sliding-window layers: the reused K/V reaches past the 16-token window
    ids = list(range(10, 60))
    engine = _engine(m, 2)
    first, again = _run(engine, [(0, ids, dict(max_tokens=8, ignore_eos=True))] * 1 +
                        [(40, ids, dict(max_tokens=8, ignore_eos=True))])
    want = m.generate(ids, max_tokens=8, ignore_eos=True).tokens
    assert first.result(0).cached_tokens == 0
    assert again.result(0).cached_tokens == 48  # every full block short of the last token
    assert first.result(0).tokens == again.result(0).tokens == want
    st_ = engine.stats()["prefix_cache"]
    assert st_["hits"] == 1 and st_["hit_tokens"] == 48 and st_["queries"] == 2


def test_generated_tokens_enter_the_cache(models):
    """Turn two of a conversation starts with turn one's prompt and answer: both are reused."""
    m = models["qwen2"]
    engine = _engine(m, 1)
    prompt = list(range(20, 41))
    (h,) = _run(engine, [(0, prompt, dict(max_tokens=12, ignore_eos=True))])
    answer = h.result(0).tokens
    follow = prompt + answer + [7, 8, 9]
    (h2,) = _run(engine, [(0, follow, dict(max_tokens=5, ignore_eos=True))])
    got = h2.result(0)
    # the last answer token's K/V was never written (no step read it back): all before it is reused
    assert got.cached_tokens == (len(prompt) + len(answer) - 1) // BS * BS > len(prompt)
    assert got.tokens == m.generate(follow, max_tokens=5, ignore_eos=True).tokens


def test_salts_keep_tenants_apart(models):
    m = models["llama"]
    ids = list(range(30, 70))
    engine = _engine(m, 1)
    hs = _run(engine, [(0, ids, dict(max_tokens=3, cache_salt="alice")), (20, ids, dict(max_tokens=3, cache_salt="bob")),
                       (40, ids, dict(max_tokens=3)), (60, ids, dict(max_tokens=3, cache_salt="alice"))])
    assert [h.result(0).cached_tokens for h in hs] == [0, 0, 0, 36]


def test_a_hash_collision_never_serves_another_prompts_kv(models, monkeypatch):
    """Every block gets the same key: lookups must still compare tokens, and miss."""
    monkeypatch.setattr(PrefixCache, "chain", staticmethod(lambda parent, tokens, salt: 42))
    m = models["qwen3"]
    a, b = list(range(100, 140)), list(range(200, 240))
    engine = _engine(m, 1)
    hs = _run(engine, [(0, a, dict(max_tokens=4, ignore_eos=True)), (20, b, dict(max_tokens=4, ignore_eos=True))])
    assert hs[1].result(0).cached_tokens == 0
    assert hs[1].result(0).tokens == m.generate(b, max_tokens=4, ignore_eos=True).tokens


def test_the_budget_bounds_the_cache_and_evicts_least_recently_used(models):
    m = models["qwen2"]
    engine = _engine(m, 1)
    cache = engine.prefix_cache
    cache.budget_bytes = 5 * cache.block_bytes
    hot, cold = list(range(50, 71)), list(range(300, 321))  # five blocks of 4 each
    reqs = [(0, hot, dict(max_tokens=1)), (20, cold, dict(max_tokens=1)), (40, hot, dict(max_tokens=1))]
    hs = _run(engine, reqs)
    assert len(cache) <= 5 and cache.counters["evictions"] > 0
    assert hs[2].result(0).cached_tokens == 0  # hot was evicted by cold
    (h,) = _run(engine, [(0, hot, dict(max_tokens=1))])
    assert h.result(0).cached_tokens == 20
    assert engine.memory()["prefix_cache_bytes"] == cache.nbytes <= cache.budget_bytes


def test_no_prefix_cache(models):
    m = models["llama"]
    engine = Engine(m, slots=1, max_len=MAX_LEN, prefix_cache_bytes=0)
    ids = list(range(10, 80))
    hs = _run(engine, [(0, ids, dict(max_tokens=2)), (10, ids, dict(max_tokens=2))])
    assert [h.result(0).cached_tokens for h in hs] == [0, 0]
    assert engine.prefix_cache is None and engine.stats()["prefix_cache"] is None
    assert engine.memory()["prefix_cache_bytes"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", True])
def test_a_bad_budget_is_refused(models, bad):
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Engine(models["llama"], slots=1, max_len=MAX_LEN, prefix_cache_bytes=bad)


@pytest.mark.parametrize("bad", [3, "x" * 257, b"salt"])
def test_a_bad_salt_is_refused(models, bad):
    with slotinfer.Inferencer(models["llama"], slots=1, max_len=MAX_LEN) as inf:
        with pytest.raises(slotinfer.InvalidRequestError, match="cache_salt") as e:
            inf.submit("hi", cache_salt=bad)
    assert e.value.param == "cache_salt"


def test_reuse_and_caching_write_the_table_in_place(models):
    """Copying blocks in and out of the slot table costs no more memory than the blocks: no layer
    of the table is duplicated (a lazy view of it held across a step would make the next K/V
    write copy the whole layer).  Measured against the same workload without a cache."""
    m = models["llama"]

    def excess(budget):
        engine = Engine(m, slots=4, max_len=4096, prefill_tokens=64, prefix_cache_bytes=budget, prefix_block_size=8)
        for rnd in range(3):  # the first two compile every variant the measured round runs
            ids = list(range(10 + rnd, 200 + rnd))
            _run(engine, [(0, ids, dict(max_tokens=4))])
            mx.eval(engine.tokens, engine.table.keys)
            cached = engine.memory()["prefix_cache_bytes"]
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            _run(engine, [(0, ids + [5], dict(max_tokens=30)), (3, ids + [6], dict(max_tokens=30))])
            mx.eval(engine.tokens)
        grown = engine.memory()["prefix_cache_bytes"] - cached
        return mx.get_peak_memory() - base - grown, grown, engine

    with_cache, grown, engine = excess(1 << 30)
    without, _, _ = excess(0)
    assert engine.stats()["prefix_cache"]["hits"] >= 2 and grown > 0
    assert with_cache < without + engine.table.keys[0].nbytes / 4


def test_serve_queue_and_batch_generate_report_cached_tokens(models):
    m = models["qwen2"]
    prompts = [list(range(40, 80)) + [i] for i in range(3, 9)]
    out = m.batch_generate(prompts, max_tokens=3, slots=2)
    assert all(r.error is None for r in out)
    with slotinfer.Inferencer(m, slots=2, max_len=MAX_LEN) as inf:
        first = inf.submit(prompts[0], max_tokens=2).result()
        later = inf.submit(prompts[1], max_tokens=2).result()
        assert first.cached_tokens == 0 and later.cached_tokens == 32  # the default 32-token blocks
        st_ = inf.stats()["prefix_cache"]
        assert st_["hit_tokens"] == 32 and st_["bytes"] == inf.memory()["prefix_cache_bytes"] > 0
    np.testing.assert_array_equal([r.tokens for r in out],
                                  [m.generate(p, max_tokens=3).tokens for p in prompts])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_template_rerenders_earlier_turns_identically(models, family):
    """Turn two's prompt starts with turn one's prompt and answer, as text and as tokens: what the
    cache keeps of turn one (prompt and generated tokens) is what turn two asks for."""
    m = models[family]
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is MLX?"}]
    answer = "MLX is an array framework."
    p1 = m.apply_chat_template(turn1)
    p2 = m.apply_chat_template(turn1 + [{"role": "assistant", "content": answer},
                                        {"role": "user", "content": "And Metal?"}])
    assert p2.startswith(p1 + answer)
    ids1, ids2 = m.encode_prompt(p1), m.encode_prompt(p2)
    ids_answer = m.tokenizer.encode(answer, add_special_tokens=False)
    assert ids2[: len(ids1) + len(ids_answer)] == ids1 + ids_answer


def test_qwen3s_template_drops_reasoning_from_earlier_turns(models):
    """The one documented exception: Qwen 3 renders an earlier answer without its <think> block, so
    turn two reuses turn one's prompt but not a reasoning answer."""
    m = models["qwen3"]
    turn1 = [{"role": "user", "content": "What is MLX?"}]
    answer = "<think>\nLet me recall.\n</think>\n\nMLX is an array framework."
    p1 = m.apply_chat_template(turn1)
    p2 = m.apply_chat_template(turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}])
    assert p2.startswith(p1) and not p2.startswith(p1 + answer) and "Let me recall" not in p2


def test_a_chats_next_turn_reuses_the_last_turns_prompt_and_answer(smollm2):
    """On the real model, whose answers are text that tokenizes back to the tokens generated."""
    m = smollm2
    with slotinfer.Inferencer(m, slots=2, max_len=512, prefix_cache_bytes=1 << 28) as inf:
        msgs = [{"role": "user", "content": "Name three rivers of Europe."}]
        first = inf.submit(messages=msgs, max_tokens=48).result()
        msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Asia?"}]
        second = inf.submit(messages=msgs, max_tokens=8).result()
    assert second.cached_tokens % 32 == 0
    assert second.cached_tokens >= (first.prompt_tokens + len(first.tokens) - 1) // 32 * 32 > first.prompt_tokens
    assert second.tokens == m.chat(msgs, max_tokens=8).tokens


def test_a_long_prompt_is_cached_chunk_by_chunk(models):
    """A prompt prefilled over several steps enters the cache as its chunks go in: a request with
    the same start that arrives before the first one's prefill is done already reuses them."""
    m = models["llama"]
    engine = _engine(m, 2, prefill=8)
    ids = list(range(100, 160))
    first, second = _run(engine, [(0, ids, dict(max_tokens=3, ignore_eos=True)),
                                  (3, ids[:40] + [7, 8], dict(max_tokens=3, ignore_eos=True))])
    assert first.result(0).cached_tokens == 0
    assert second.result(0).cached_tokens == 24  # the first three chunks (8 tokens each) were in by then
    assert second.result(0).tokens == m.generate(ids[:40] + [7, 8], max_tokens=3, ignore_eos=True).tokens
