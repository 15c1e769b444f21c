"""The prefix cache, which is the block pool's registered blocks: a hit gives the tokens of a cold
run, shares the blocks by reference (no row ever writes into a shared block), is never served
across salts or by a hash collision, stays within its cap and the pool's budget, and happens.

The engine properties run on tiny models of every family (Gemma's 16-token sliding window
included) with the engine's own block size, so prompts of a few hundred tokens span several blocks.
"""

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import slotinfer
from slotinfer.engine.engine import Engine
from slotinfer.kv import KV_BLOCK_SIZE as BS
from slotinfer.kv import BlockPool, block_bytes
from slotinfer.testing import FAMILIES
from test_properties import feed as _run

MAX_LEN = 4 * BS + 64


def _engine(model, slots, *, cap_blocks=None, pool_blocks=None, prefill=BS):
    each = _block(model)
    return Engine(model, slots=slots, max_len=MAX_LEN, prefill_tokens=prefill,
                  prefix_cache_bytes=(cap_blocks if cap_blocks is not None else 1000) * each,
                  kv_cache_bytes=None if pool_blocks is None else (pool_blocks + 2) * each)


def _block(model):
    import mlx.core as mx

    c = model.config
    return block_bytes(num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=mx.float32,
                       block_size=BS)


def _alone(m, ids, params):
    return m.generate(ids, **{k: v for k, v in params.items() if k != "cache_salt"})


@st.composite
def shared_prefix_requests(draw):
    """Prompts drawn from a few shared prefixes (up to three blocks), each with its own continuation;
    some repeated."""
    prefixes = draw(st.lists(st.lists(st.integers(3, 500), min_size=1, max_size=3 * BS), min_size=1, max_size=3))
    out = []
    for _ in range(draw(st.integers(2, 6))):
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
@given(reqs=shared_prefix_requests(), slots=st.integers(1, 4), cap_blocks=st.sampled_from([1, 3, 1000]),
       pool_blocks=st.sampled_from([None, 8]))
def test_cache_hits_give_the_tokens_of_a_cold_run(models, family, reqs, slots, cap_blocks, pool_blocks):
    """Under a small cap and a small pool (allocation evicting cached blocks) hits stay exact, and
    no write lands in a shared block: ``BlockPool.locate``, the one way to a write's place, refuses
    one, which would fail the request (``result`` raises) and the engine's other rows."""
    m = models[family]
    engine = _engine(m, slots, cap_blocks=cap_blocks, pool_blocks=pool_blocks)
    pool = engine.table.pool
    shared = []
    handles = _run(engine, reqs, on_step=lambda *_: shared.append(int((pool.ref > 1).sum())))
    for (_, ids, params), h in zip(reqs, handles):
        got = h.result(0)
        want = _alone(m, ids, params)
        assert got.tokens == want.tokens and got.text == want.text
        assert 0 <= got.cached_tokens < len(ids)
    event("blocks shared by running rows" if max(shared) else "no block shared at once")
    event("a partial block reused" if pool.counters["partial_hits"] else "no partial block reused")
    assert len(pool.cached) <= cap_blocks and pool.num_used == 0 and (pool.ref == 0).all()
    assert engine.items.free == list(range(slots)) and not engine.busy


def test_a_repeated_prompt_hits_and_is_token_exact(models):
    m = models["gemma3_text"]  # sliding-window layers: the reused K/V reaches past the 16-token window
    ids = [10 + i % 400 for i in range(2 * BS + 2)]
    engine = _engine(m, 2)
    first, again = _run(engine, [(0, ids, dict(max_tokens=8, ignore_eos=True)),
                                 (40, ids, dict(max_tokens=8, ignore_eos=True))])
    want = m.generate(ids, max_tokens=8, ignore_eos=True).tokens
    assert first.result(0).cached_tokens == 0
    assert again.result(0).cached_tokens == 2 * BS + 1  # every token short of the last, the partial block copied
    assert first.result(0).tokens == again.result(0).tokens == want
    st_ = engine.stats()["prefix_cache"]
    assert st_["hits"] == 1 and st_["hit_tokens"] == 2 * BS + 1 and st_["queries"] == 2 and st_["partial_hits"] == 1


def test_a_hit_shares_the_blocks_by_reference(models):
    """Two requests that start with a cached prefix hold the same blocks (no copy), each with its own tail."""
    m = models["llama"]
    prefix = [20 + i % 300 for i in range(2 * BS)]
    engine = _engine(m, 2)
    _run(engine, [(0, prefix + [5], dict(max_tokens=2, ignore_eos=True))])
    tables = []

    def look(step, handles):
        pool = engine.table.pool
        if step == 1:
            tables.append((pool.tables[:, :3].tolist(), pool.ref.copy(), pool.num_used))

    hs = _run(engine, [(0, prefix + [6, 7], dict(max_tokens=4, ignore_eos=True)),
                       (0, prefix + [8, 9], dict(max_tokens=4, ignore_eos=True))], on_step=look)
    (t, ref, used), = tables
    assert t[0][:2] == t[1][:2] and all(ref[b] == 2 for b in t[0][:2])
    assert t[0][2] != t[1][2] and used == 2 + 2  # the shared two, and one tail block each
    assert [h.result(0).cached_tokens for h in hs] == [2 * BS, 2 * BS]
    assert [h.result(0).tokens for h in hs] == [m.generate(prefix + t, max_tokens=4, ignore_eos=True).tokens
                                                for t in ([6, 7], [8, 9])]


def test_generated_tokens_enter_the_cache(models):
    """Turn two of a conversation starts with turn one's prompt and answer: both are reused."""
    m = models["qwen2"]
    engine = _engine(m, 1)
    prompt = [20 + i % 300 for i in range(BS - 4)]
    (h,) = _run(engine, [(0, prompt, dict(max_tokens=12, ignore_eos=True))])
    answer = h.result(0).tokens
    follow = prompt + answer + [7, 8, 9]
    (h2,) = _run(engine, [(0, follow, dict(max_tokens=5, ignore_eos=True))])
    got = h2.result(0)
    # the last answer token's K/V was never written (no step read it back): all before it is reused,
    # the partial block after the full one adopted
    assert got.cached_tokens == len(prompt) + len(answer) - 1 > BS
    assert engine.stats()["prefix_cache"]["partial_hits"] == 1
    assert got.tokens == m.generate(follow, max_tokens=5, ignore_eos=True).tokens


def test_salts_keep_tenants_apart(models):
    m = models["llama"]
    ids = [30 + i % 300 for i in range(BS + 10)]
    engine = _engine(m, 1)
    hs = _run(engine, [(0, ids, dict(max_tokens=3, cache_salt="alice")), (20, ids, dict(max_tokens=3, cache_salt="bob")),
                       (40, ids, dict(max_tokens=3)), (60, ids, dict(max_tokens=3, cache_salt="alice"))])
    assert [h.result(0).cached_tokens for h in hs] == [0, 0, 0, BS]


def test_a_hash_collision_never_serves_another_prompts_kv(models, monkeypatch):
    """Every block gets the same key: lookups must still compare tokens, and miss."""
    monkeypatch.setattr(BlockPool, "chain", staticmethod(lambda parent, tokens, salt: 42))
    m = models["qwen3"]
    a, b = [100 + i % 300 for i in range(BS + 8)], [200 + i % 300 for i in range(BS + 8)]
    engine = _engine(m, 1)
    hs = _run(engine, [(0, a, dict(max_tokens=4, ignore_eos=True)), (20, b, dict(max_tokens=4, ignore_eos=True))])
    assert hs[1].result(0).cached_tokens == 0
    assert hs[1].result(0).tokens == m.generate(b, max_tokens=4, ignore_eos=True).tokens


def test_the_cap_bounds_the_cache_and_evicts_least_recently_used(models):
    m = models["qwen2"]
    engine = _engine(m, 1, cap_blocks=2)
    hot, cold = [50 + i % 300 for i in range(2 * BS + 1)], [300 - i % 200 for i in range(2 * BS + 1)]  # two blocks each
    hs = _run(engine, [(0, hot, dict(max_tokens=1)), (20, cold, dict(max_tokens=1)), (40, hot, dict(max_tokens=1))])
    pool = engine.table.pool
    assert len(pool.cached) <= 2 and pool.counters["evicted"] > 0
    assert hs[2].result(0).cached_tokens == 0  # hot was evicted by cold
    (h,) = _run(engine, [(0, hot, dict(max_tokens=1))])
    assert h.result(0).cached_tokens == 2 * BS
    mem = engine.memory()
    assert mem["prefix_cache_bytes"] == len(pool.cached) * mem["block_bytes"] <= mem["prefix_cache_budget_bytes"]


def test_cached_blocks_are_free_capacity_and_allocation_evicts_them(models):
    """A pool of four blocks: a cached prefix gives way to the next request's blocks, never refusing it."""
    m = models["llama"]
    engine = _engine(m, 1, pool_blocks=4)
    a, b = [40 + i % 300 for i in range(2 * BS + 1)], [41 + i % 300 for i in range(3 * BS + 1)]
    hs = _run(engine, [(0, a, dict(max_tokens=1)), (5, b, dict(max_tokens=1)), (10, a, dict(max_tokens=1))])
    assert [h.result(0).cached_tokens for h in hs] == [0, 0, 0]
    assert all(h.result(0).finish_reason == "length" for h in hs)
    assert engine.table.pool.counters["evicted"] >= 2


def test_no_prefix_cache(models):
    m = models["llama"]
    engine = Engine(m, slots=1, max_len=MAX_LEN, prefix_cache_bytes=0)
    ids = [10 + i % 300 for i in range(BS + 20)]
    hs = _run(engine, [(0, ids, dict(max_tokens=2)), (10, ids, dict(max_tokens=2))])
    assert [h.result(0).cached_tokens for h in hs] == [0, 0]
    assert engine.stats()["prefix_cache"] is None and not engine.table.pool.meta
    assert engine.memory()["prefix_cache_bytes"] == engine.memory()["prefix_cache_budget_bytes"] == 0


def test_the_budget_is_reported_before_the_first_request(models):
    engine = Engine(models["llama"], slots=1, max_len=MAX_LEN, prefix_cache_bytes=64 << 20)
    mem = engine.memory()
    assert mem["prefix_cache_budget_bytes"] == 64 << 20 and mem["prefix_cache_bytes"] == 0
    assert mem["kv_cache_bytes"] == mem["blocks"] * mem["block_bytes"] + 2 * mem["block_bytes"]


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


def test_an_idle_pool_shrinks_and_keeps_its_cache(models):
    """After a burst the arrays are cut back to the idle size plus the cached blocks, which move to
    the lowest ids and still hit, token-exact."""
    m = models["llama"]
    engine = _engine(m, 8, cap_blocks=2)
    burst = [[60 + i + j % 250 for j in range(2 * BS + 3)] for i in range(8)]
    _run(engine, [(0, ids, dict(max_tokens=3, ignore_eos=True)) for ids in burst])
    t = engine.table
    assert t.keys[0].shape[0] == max(t.idle_blocks, 2 + len(t.pool.cached)) and len(t.pool.cached) == 2
    assert sorted(t.pool.cached) == [2, 3]
    (h,) = _run(engine, [(0, burst[-1], dict(max_tokens=3, ignore_eos=True))])
    assert h.result(0).cached_tokens == 2 * BS
    assert h.result(0).tokens == m.generate(burst[-1], max_tokens=3, ignore_eos=True).tokens


def test_serve_queue_and_batch_generate_report_cached_tokens(models):
    m = models["qwen2"]
    prompts = [[40 + j % 300 for j in range(2 * BS)] + [i] for i in range(3, 9)]
    out = m.batch_generate(prompts, max_tokens=3, slots=2)
    assert all(r.error is None for r in out)
    with slotinfer.Inferencer(m, slots=2, max_len=MAX_LEN) as inf:
        first = inf.submit(prompts[0], max_tokens=2).result()
        later = inf.submit(prompts[1], max_tokens=2).result()
        assert first.cached_tokens == 0 and later.cached_tokens == 2 * BS
        st_ = inf.stats()["prefix_cache"]
        assert st_["hit_tokens"] == 2 * BS and st_["bytes"] == inf.memory()["prefix_cache_bytes"] > 0
    assert [r.tokens for r in out] == [m.generate(p, max_tokens=3).tokens for p in prompts]


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
        msgs = [{"role": "system", "content": "You answer questions about geography in short lists. " * 8},
                {"role": "user", "content": "Name three rivers of Europe."}]
        first = inf.submit(messages=msgs, max_tokens=48).result()
        msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Asia?"}]
        second = inf.submit(messages=msgs, max_tokens=8).result()
    assert first.prompt_tokens // BS < (first.prompt_tokens + len(first.tokens) - 1) // BS  # the answer crosses a block
    assert second.cached_tokens == first.prompt_tokens + len(first.tokens) - 1  # all that turn one wrote
    assert second.tokens == m.chat(msgs, max_tokens=8).tokens


def test_a_long_prompt_is_cached_chunk_by_chunk(models):
    """A prompt prefilled over several steps enters the cache as its chunks go in: a request with
    the same start that arrives before the first one's prefill is done already reuses them."""
    m = models["llama"]
    engine = _engine(m, 2, prefill=BS)
    ids = [100 + i % 300 for i in range(4 * BS)]
    first, second = _run(engine, [(0, ids, dict(max_tokens=3, ignore_eos=True)),
                                  (3, ids[:3 * BS + 8] + [7, 8], dict(max_tokens=3, ignore_eos=True))])
    assert first.result(0).cached_tokens == 0
    assert second.result(0).cached_tokens == 3 * BS  # the first three chunks (one block each) were in by then
    assert second.result(0).tokens == m.generate(ids[:3 * BS + 8] + [7, 8], max_tokens=3, ignore_eos=True).tokens


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@given(first=st.lists(st.integers(3, 500), min_size=1, max_size=2 * BS + 40), new=st.integers(1, 12),
       keep=st.integers(0, 12), more=st.lists(st.integers(3, 500), min_size=1, max_size=8),
       others=st.integers(0, 2), slots=st.integers(1, 3), salt=st.sampled_from([None, "a"]))
def test_a_next_turn_reuses_all_the_turn_before_wrote(models, family, first, new, keep, more, others, slots, salt):
    """Turn two starts with some of turn one's prompt and answer: it reuses every token turn one wrote
    that it shares, its partial last block adopted (all of it shared) or copied (a part), and its
    tokens are those of a cold run, alone or beside other rows."""
    m = models[family]
    engine = _engine(m, slots)
    (h,) = _run(engine, [(0, first, dict(max_tokens=new, ignore_eos=True, cache_salt=salt))])
    written = first + h.result(0).tokens[:-1]  # the last token's K/V is never written
    follow = first + h.result(0).tokens[:keep] + more
    others = [(i, [7 + i] * (5 + 60 * i), dict(max_tokens=3, ignore_eos=True)) for i in range(others)]
    got = _run(engine, [(0, follow, dict(max_tokens=5, ignore_eos=True, cache_salt=salt)), *others])[0].result(0)
    shared = next((i for i, (a, b) in enumerate(zip(written, follow[:-1])) if a != b), min(len(written),
                                                                                          len(follow) - 1))
    assert got.cached_tokens == shared
    assert got.tokens == m.generate(follow, max_tokens=5, ignore_eos=True).tokens
    event("adopted" if shared == len(written) else "copied" if shared % BS else "whole blocks only")
