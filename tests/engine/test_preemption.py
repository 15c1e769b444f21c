"""Preemption by recompute: when the K/V pool runs short mid-generation, the newest request leaves
its slot, waits first in the FIFO, and resumes from its prompt and the tokens it has, with the
same output as an uninterrupted run and nothing streamed twice."""

import mlx.core as mx
import pytest

import slotinfer
from slotinfer.engine.engine import Engine
from slotinfer.kv import KV_BLOCK_SIZE, block_bytes


def _engine(m, *, blocks, slots, prefix_cache_bytes=0, prefill=512):
    c = m.config
    each = block_bytes(num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=mx.float32,
                       block_size=KV_BLOCK_SIZE)
    return Engine(m, slots=slots, max_len=600, prefill_tokens=prefill, kv_cache_bytes=(blocks + 2) * each,
                  prefix_cache_bytes=prefix_cache_bytes)


def _prompt(i, n):
    return [3 + (7 * i + 11 * j) % 400 for j in range(n)]


def _until_preempted(m, *, blocks, slots, n, max_tokens):
    """An engine serving ``n`` 120-token prompts, stepped until its first preemption; and their items."""
    engine = _engine(m, blocks=blocks, slots=slots)
    items = [engine.make_item(_prompt(i, 120), max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    for it in items:
        engine.add(it)
    while not engine.counters["preempted"]:
        engine.step()
    return engine, items


PARAMS = [
    dict(max_tokens=60, ignore_eos=True),
    dict(max_tokens=60, ignore_eos=True, temperature=0.9, seed=7),
    dict(max_tokens=60, ignore_eos=True, temperature=0.8, top_k=20, seed=11, presence_penalty=0.5,
         frequency_penalty=0.3, repetition_penalty=1.2),
    dict(max_tokens=60, ignore_eos=True, temperature=0.0, logit_bias={5: 2.0}, frequency_penalty=0.8),
]


@pytest.mark.parametrize("cache", [0, 1 << 22])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_requests_preempted_when_blocks_run_out_resume_with_their_solo_output(models, family, cache):
    """Four requests of 100-token prompts and 60 new tokens need two 128-token blocks each, in a pool
    of three: each is admitted with one, and crossing into a second preempts the newest.  Every one
    (greedy, seeded sampling, penalties, logit_bias) ends with the tokens and text of a solo run;
    what it streamed is exactly its output, each token once; and every block is back at the end.
    With a prefix cache, a resumed request starts from the blocks it held."""
    m = models[family]
    engine = _engine(m, blocks=3, slots=4, prefix_cache_bytes=cache)
    items = [engine.make_item(_prompt(i, 100), **PARAMS[i]) for i in range(4)]
    streamed = {it.id: [] for it in items}
    for it in items:
        it.on_token = lambda ev, i=it.id: streamed[i].append(ev)
        engine.add(it)
    engine.run_until_done()
    assert engine.counters["preempted"] >= 2
    for i, it in enumerate(items):
        got, want = it.handle.result(0), m.generate(_prompt(i, 100), **PARAMS[i])
        assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, want.finish_reason)
        assert [e.token for e in streamed[it.id]] == got.tokens
        assert "".join(e.text for e in streamed[it.id]) == got.text
    pool = engine.table.pool
    assert pool.num_used == 0 and not pool.tables.any() and engine.items.free == [0, 1, 2, 3]


def test_a_preempted_request_resumes_from_its_cached_blocks(models):
    """The newest request, preempted past its first full block, leaves that block cached in the pool;
    nothing evicts it while the oldest finishes (the oldest grows into the preempted one's other
    block), so its recompute shares it and prefills only the rest, with the tokens of a solo run."""
    m = models["llama"]
    engine = _engine(m, blocks=3, slots=2, prefix_cache_bytes=1 << 22)
    first = engine.make_item(_prompt(0, 10), max_tokens=200, ignore_eos=True)
    newest = engine.make_item(_prompt(1, 130), max_tokens=200, ignore_eos=True)
    for it in (first, newest):
        engine.add(it)
    engine.run_until_done()
    assert engine.counters["preempted"] >= 1
    assert engine.table.pool.counters["hit_blocks"] >= 1  # the resumed feed started from its own first block
    for it, (i, n) in ((first, (0, 10)), (newest, (1, 130))):
        assert it.handle.result(0).tokens == m.generate(_prompt(i, n), max_tokens=200, ignore_eos=True).tokens
    assert newest.handle.result(0).cached_tokens == 0  # the usage reports its first admission's hit


def test_the_oldest_request_keeps_its_slot_and_the_newest_is_preempted(models):
    """Blocks run short: the request submitted last goes back to the front of the FIFO (before the
    ones that never started), and the first one runs on."""
    m = models["llama"]
    engine, items = _until_preempted(m, blocks=2, slots=3, n=3, max_tokens=20)
    assert items[0].slot >= 0 and items[1].slot < 0 and engine.items.waiting[0] is items[1]
    assert list(engine.items.waiting) == [items[1], items[2]]
    assert items[1].feed == items[1].prompt + items[1].tokens and items[1].tokens
    engine.run_until_done()
    for i, it in enumerate(items):
        assert it.handle.result(0).tokens == m.generate(_prompt(i, 120), max_tokens=20, ignore_eos=True).tokens


def test_a_preempted_request_can_be_cancelled_while_it_waits(models):
    m = models["llama"]
    engine, items = _until_preempted(m, blocks=2, slots=2, n=2, max_tokens=30)
    victim = items[1]
    had = list(victim.tokens)
    victim.handle.cancel()
    engine.run_until_done()
    got = victim.handle.result(0)
    assert got.finish_reason == "cancelled" and got.tokens == had
    assert items[0].handle.result(0).tokens == m.generate(_prompt(0, 120), max_tokens=30, ignore_eos=True).tokens
    assert engine.table.pool.num_used == 0


def test_the_inferencer_serves_more_requests_than_its_pool_holds_at_once(models):
    """Through the threaded Inferencer and its statistics: requests whose K/V together exceed the
    pool all finish with their solo tokens, and the preemptions are counted."""
    m = models["qwen3"]
    c = m.config
    each = block_bytes(num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=mx.float32,
                       block_size=KV_BLOCK_SIZE)
    prompts = [_prompt(i, 110) for i in range(5)]
    with slotinfer.Inferencer(m, slots=5, max_len=512, kv_cache_bytes=(4 + 2) * each) as inf:
        handles = [inf.submit(p, max_tokens=40, ignore_eos=True) for p in prompts]
        got = [h.result(timeout=120) for h in handles]
        stats = inf.stats()
    assert stats["preempted"] >= 1
    assert [g.tokens for g in got] == [m.generate(p, max_tokens=40, ignore_eos=True).tokens for p in prompts]


def test_constrained_requests_preempted_resume_within_their_constraint(models):
    """A constrained request preempted mid-output resumes with its matcher where it was: the first
    token after its recompute is masked by what it already produced, and the output is its solo run's."""
    m = models["llama"]
    engine = _engine(m, blocks=2, slots=2)
    kinds = [dict(regex="[a-z ]{40,80}"), dict(regex="[0-9]{30,70}")]
    items = [engine.make_item(_prompt(i, 110), max_tokens=60, **kinds[i]) for i in range(2)]
    for it in items:
        engine.add(it)
    engine.run_until_done()
    assert engine.counters["preempted"] >= 1
    for i, it in enumerate(items):
        got, want = it.handle.result(0), m.generate(_prompt(i, 110), max_tokens=60, **kinds[i])
        assert (got.tokens, got.text) == (want.tokens, want.text)
