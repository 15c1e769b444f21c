"""The slot engine against the single-sequence reference, plus its worker, queues and errors."""

import asyncio
import queue
import threading

import mlx.core as mx
import numpy as np
import pytest

import slotinfer
from slotinfer.kv.views import SequenceCache
from slotinfer.engine.engine import Engine
from slotinfer.errors import EngineClosed, EngineError, InvalidRequestError, PromptTooLongError, QueueFull
from slotinfer.testing import FAMILIES

PROMPTS = [
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up and leaves.",
    "x",
    "Les enfants jouent dans le jardin pendant que le soleil se couche.",
]


@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_generate_matches_generate(models, family, speculative):
    m = models[family]
    refs = [m.generate(p, max_tokens=12) for p in PROMPTS]
    got = m.batch_generate(PROMPTS, max_tokens=12, slots=3, prefill_tokens=16, speculative=speculative)
    assert [g.tokens for g in got] == [r.tokens for r in refs]
    assert [g.text for g in got] == [r.text for r in refs]
    assert [g.finish_reason for g in got] == [r.finish_reason for r in refs]


def test_batch_generate_within_a_one_block_pool_serves_prompts_in_turn(models):
    """A K/V pool of one block (and the two reserved) holds one prompt at a time on 3 slots: the
    others wait for its block, and each gets its solo tokens."""
    m = models["llama"]
    c = m.config
    block = 2 * c.num_layers * c.num_kv_heads * 128 * c.head_dim * 4
    got = m.batch_generate(PROMPTS, max_tokens=12, slots=3, kv_cache_bytes=3 * block)
    assert [g.tokens for g in got] == [m.generate(p, max_tokens=12).tokens for p in PROMPTS]


def test_batch_generate_keeps_order_and_isolates_bad_prompts(models):
    m = models["qwen3"]
    got = m.batch_generate(["Hello", "", 42, "world", [10**9]], max_tokens=4)
    assert got[0].error is None and got[3].error is None
    assert [type(got[i].error) for i in (1, 2, 4)] == [InvalidRequestError] * 3
    assert got[0].tokens == m.generate("Hello", max_tokens=4).tokens
    assert got[3].tokens == m.generate("world", max_tokens=4).tokens


def test_stop_string_across_tokens_is_not_emitted(models):
    m = models["llama"]
    ref = m.generate(PROMPTS[1], max_tokens=24, ignore_eos=True)
    assert len(ref.text) > 8
    stop = ref.text[3:7]  # spans token boundaries in general
    want = m.generate(PROMPTS[1], max_tokens=24, ignore_eos=True, stop=[stop])
    assert want.finish_reason == "stop" and stop not in want.text
    assert want.text == ref.text[: ref.text.find(stop)]
    with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
        h = inf.submit(PROMPTS[1], max_tokens=24, ignore_eos=True, stop=[stop])
        streamed = "".join(ev.text for ev in h)
        got = h.result()
    assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, want.finish_reason)
    assert streamed == got.text


def test_stop_token_ids_and_ignore_eos(models):
    m = models["qwen2"]
    ref = m.generate(PROMPTS[0], max_tokens=10, ignore_eos=True)
    stop_id = ref.tokens[4]
    first = ref.tokens.index(stop_id)
    got = m.batch_generate([PROMPTS[0]], max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id])[0]
    assert got.tokens == ref.tokens[: first + 1] and got.finish_reason == "stop"


def test_logprobs_match_a_full_forward(models):
    m = models["gemma2"]
    with slotinfer.Inferencer(m, slots=2, max_len=64) as inf:
        c = inf.generate(PROMPTS[0], max_tokens=6, ignore_eos=True, top_logprobs=3)
    ids = m.encode_prompt(PROMPTS[0])
    seq = ids + c.tokens
    h = m.net(mx.array([seq]), SequenceCache(m.config.num_layers))
    logits = m.net.head(h[0, len(ids) - 1: len(seq) - 1]).astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    want = [ref[i, t] for i, t in enumerate(c.tokens)]
    np.testing.assert_allclose(c.logprobs, want, atol=2e-4)
    assert len(c.top_logprobs) == 6 and all(len(t) == 3 for t in c.top_logprobs)
    best = [int(np.argmax(ref[i])) for i in range(6)]
    assert [t[0][0] for t in c.top_logprobs] == best


def test_each_row_gets_its_own_number_of_top_logprobs(models):
    m = models["qwen2"]
    with slotinfer.Inferencer(m, slots=3, max_len=64) as inf:
        hs = [inf.submit(p, max_tokens=4, ignore_eos=True, **kw) for p, kw in
              zip(PROMPTS, [dict(top_logprobs=2), dict(top_logprobs=5), dict(logprobs=True)])]
        a, b, c = [h.result(timeout=60) for h in hs]
    assert [len(t) for t in a.top_logprobs] == [2] * 4 and [len(t) for t in b.top_logprobs] == [5] * 4
    assert [t[0][0] for t in a.top_logprobs] == a.tokens and [t[0][0] for t in b.top_logprobs] == b.tokens  # greedy
    assert c.top_logprobs is None and len(c.logprobs) == 4
    alone = m.batch_generate([PROMPTS[0]], max_tokens=4, ignore_eos=True, top_logprobs=2)
    assert a.tokens == alone[0].tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_len", [100, 128])
def test_a_slot_left_idle_never_poisons_its_next_occupant(models, family, max_len):
    """An idle row of a sliding-window layer sees no key at all (NaN), and writes the trash column;
    a later occupant's step must never read that column, whatever max_len's rounding."""
    m = models[family]
    first, second = list(range(5, 15)), list(range(100, 170))  # the second longer than the window and 64
    engine = Engine(m, slots=2, max_len=max_len)
    a = engine.make_item(first, max_tokens=20, ignore_eos=True)
    engine.add(a)
    for _ in range(5):
        engine.step()  # slot 1 idles through these decode steps
    b = engine.make_item(second, max_tokens=25, ignore_eos=True)
    engine.add(b)
    engine.run_until_done()
    assert a.handle.result(0).tokens == m.generate(first, max_tokens=20, ignore_eos=True).tokens
    assert b.handle.result(0).tokens == m.generate(second, max_tokens=25, ignore_eos=True).tokens


def test_max_len_is_validated_at_submit(models):
    m = models["qwen3"]
    with slotinfer.Inferencer(m, slots=1, max_len=16) as inf:
        with pytest.raises(PromptTooLongError, match="max_len") as e:
            inf.submit(PROMPTS[1], max_tokens=4)
        n = len(m.encode_prompt(PROMPTS[1]))
        assert f"max_tokens is 4: {n + 4} > the engine's max_len 16" in str(e.value)
        assert n >= 16 and e.value.param == "prompt" and "shorten the prompt to at most 15 tokens" in str(e.value)
        assert (e.value.prompt_tokens, e.value.max_tokens, e.value.limit, e.value.most) == (n, 4, 16, None)
        with pytest.raises(PromptTooLongError, match=r"lower max_tokens \(to at most 12\)") as e:
            inf.submit([5, 6, 7, 8], max_tokens=20)
        assert e.value.param == "max_tokens" and (e.value.need, e.value.setting) == (24, "max_len")
        with pytest.raises(PromptTooLongError, match="max_tokens is 1000000: ") as e:  # the figure asked for, not a clamp
            inf.submit("hi", max_tokens=1_000_000)
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            inf.submit("hi", max_tokens=0)
        with pytest.raises(InvalidRequestError, match="temperature"):
            inf.submit("hi", temperature=-1)
        assert inf.generate("hi", max_tokens=3).tokens == m.generate("hi", max_tokens=3).tokens


def test_queue_full_and_closed(models):
    m = models["qwen3"]
    inf = slotinfer.Inferencer(m, slots=1, max_len=64, max_queue=1, start=False)
    inf.submit("hello", max_tokens=2)
    with pytest.raises(QueueFull):
        inf.submit("hello", max_tokens=2, block=False)
    inf.start()
    inf.close()
    with pytest.raises(EngineClosed):
        inf.submit("hello")


def test_close_without_drain_cancels_everything(models):
    m = models["llama"]
    inf = slotinfer.Inferencer(m, slots=1, max_len=256, start=False)
    handles = [inf.submit(p, max_tokens=200, ignore_eos=True) for p in PROMPTS]
    inf.start()
    inf.close(drain=False)
    reasons = [h.result(timeout=30).finish_reason for h in handles]
    assert set(reasons) <= {"cancelled", "length"} and "cancelled" in reasons
    assert inf.engine.items.free == [0]


_EXIT_SCRIPT = """
import sys, threading
import slotinfer
m = slotinfer.load(sys.argv[1])
with slotinfer.Inferencer(m, slots=4, max_len=128) as inf:
    hs = [inf.submit("hello there " * (i + 1), max_tokens=6, ignore_eos=True) for i in range(4)]
    got = [len(h.result().tokens) for h in hs]
t = threading.Thread(target=lambda: m.generate("a user thread", max_tokens=3))
t.start(); t.join()
print(got)
"""


def test_process_exits_cleanly_after_worker_and_user_threads(model_dir):
    # Compiled traces live in MLX's thread-local storage; a worker thread's traces that outlive
    # it abort the process at interpreter exit. Several runs: the abort is a race with teardown.
    import subprocess
    import sys

    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(model_dir("qwen3"))],
                           capture_output=True, text=True, timeout=300)
        assert (p.returncode, p.stdout.strip()) == (0, "[6, 6, 6, 6]"), p.stderr[-2000:]


def test_asyncio_generate_and_stream(models):
    m = models["qwen2"]
    want = m.generate(PROMPTS[0], max_tokens=8)

    async def main(inf):
        a = await inf.generate_async(PROMPTS[0], max_tokens=8)
        events = [ev async for ev in inf.stream_async(PROMPTS[0], max_tokens=8)]
        return a, events

    with slotinfer.Inferencer(m, slots=2, max_len=64) as inf:
        a, events = asyncio.run(main(inf))
    assert a.tokens == want.tokens
    assert [e.token for e in events] == want.tokens
    assert "".join(e.text for e in events) == want.text


def test_asyncio_chat_and_stream_chat_render_the_models_template(models):
    m = models["qwen3"]
    messages = [{"role": "user", "content": "Say something."}]
    want = m.chat(messages, max_tokens=6, ignore_eos=True)

    async def main(inf):
        c = await inf.chat_async(messages, max_tokens=6, ignore_eos=True)
        events = [ev async for ev in inf.stream_chat_async(messages, max_tokens=6, ignore_eos=True)]
        return c, events

    with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
        c, events = asyncio.run(main(inf))
    assert c.prompt_tokens == len(m.encode_prompt(m.apply_chat_template(messages))) != len(m.encode_prompt(messages[0]["content"]))
    assert c.tokens == want.tokens == [e.token for e in events]


def test_serve_queue_from_producer_threads(models):
    m = models["gemma3_text"]
    in_q, out_q = queue.Queue(), queue.Queue()
    reqs = [{"id": i, "prompt": p, "max_tokens": 5} for i, p in enumerate(PROMPTS)] + [{"id": "bad", "prompt": ""}]
    with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
        server = threading.Thread(target=inf.serve_queue, args=(in_q, out_q))
        server.start()
        producers = [threading.Thread(target=in_q.put, args=(r,)) for r in reqs]
        [p.start() for p in producers]
        [p.join() for p in producers]
        in_q.put(None)
        server.join(timeout=60)
    out = []
    while (c := out_q.get(timeout=5)) is not None:
        out.append(c)
    by_id = {c.request_id: c for c in out}
    assert sorted(by_id, key=str) == sorted([r["id"] for r in reqs], key=str) and len(out) == len(reqs)
    assert by_id["bad"].finish_reason == "error" and isinstance(by_id["bad"].error, InvalidRequestError)
    for i, p in enumerate(PROMPTS):
        assert by_id[i].tokens == m.generate(p, max_tokens=5).tokens


def test_stats_and_memory_are_reported(models):
    m = models["qwen3"]
    with slotinfer.Inferencer(m, slots=4, max_len=64) as inf:
        for h in [inf.submit(p, max_tokens=4, ignore_eos=True) for p in PROMPTS]:
            c = h.result()
            assert c.metrics["queue_wait_s"] >= 0 and c.metrics["time_to_first_token_s"] > 0
        s, mem = inf.stats(), inf.memory()
    assert s["finished"] == 4 and s["decode_tokens"] >= 4 * 3 and s["steps"] >= 3
    assert 0 < s["mean_occupancy"] <= 4
    c = m.config
    # the default pool: 4 slots of one 128-token block each (max_len 64), and the two reserved blocks
    block = 2 * c.num_layers * c.num_kv_heads * 128 * c.head_dim * 4
    assert mem["kv_cache_bytes"] == (4 + 2) * block and mem["block_bytes"] == block
    assert mem["block_tokens"] == 128 and mem["kv_allocated_bytes"] == mem["blocks_allocated"] * block
    assert mem["blocks"] == 4 and s["blocks"] == 4 and s["blocks_used"] == 0 and s["blocks_free"] == 4


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_no_decode_step_beyond_the_budget(models, max_tokens):
    """A batch whose items all run to max_tokens costs exactly max_tokens - 1 decode steps
    (the first token comes from the Encoder): no step is spent on rows whose budget is
    already in flight, and max_tokens=1 needs none at all."""
    m = models["qwen3"]
    eng = Engine(m, slots=4, max_len=64)
    items = [eng.make_item(p, max_tokens=max_tokens, ignore_eos=True) for p in PROMPTS]
    for it in items:
        eng.add(it)
    eng.run_until_done()
    assert eng.counters["steps"] == max_tokens - 1
    assert eng.counters["decode_tokens"] == 4 * (max_tokens - 1)
    for p, it in zip(PROMPTS, items):
        c = it.handle.result(timeout=0)
        assert c.finish_reason == "length"
        assert c.tokens == m.generate(p, max_tokens=max_tokens, ignore_eos=True).tokens


def test_kv_cache_is_written_in_place_while_steps_overlap(model_dir):
    """Pipelined decode steps (step t+1 issued while step t runs) update every layer's
    K/V in place: no step ever holds a second copy of a layer, whose cost would follow
    max_len.  (A model wide enough that a step outlasts the host's bookkeeping, so
    steps really overlap.)"""
    m = slotinfer.load(model_dir("qwen3", overrides={"hidden_size": 512, "intermediate_size": 1536,
                                                      "num_hidden_layers": 3}))
    eng = Engine(m, slots=16, max_len=4096)
    for i in range(16):
        eng.add(eng.make_item(PROMPTS[i % 4], max_tokens=2000, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.table.grow(range(16), [2000] * 16)  # blocks taken ahead: the arrays are large beside a step's work
    eng.table.cover()
    mx.eval(eng.tokens)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(30):
        eng.step()
    mx.eval(eng.tokens)
    assert eng.table.keys[0].shape[0] >= 2 + 16 * 16
    assert mx.get_peak_memory() - base < eng.table.keys[0].nbytes / 4


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_memory_does_not_grow_over_batches(models, max_tokens):
    """Batch after batch through one engine holds no more memory than the first: nothing
    of a finished batch stays reachable (a prefill-only batch, max_tokens=1, writes K/V
    that no decode step reads).  Only a few KiB move between batches (a step variant first
    compiled in a later batch, the allocator's small buffers), where a batch's graph kept
    alive would hold a whole version of the table."""
    m = models["llama"]
    eng = Engine(m, slots=4, max_len=64)
    active = []
    for _ in range(5):
        for p in PROMPTS:
            eng.add(eng.make_item(p, max_tokens=max_tokens, ignore_eos=True))
        eng.run_until_done()
        mx.eval(eng.tokens)
        active.append(mx.get_active_memory())
    assert max(active[1:]) - active[0] < eng.table.allocated_bytes / 8


def test_engine_rejects_bad_construction(models):
    with pytest.raises(ValueError):
        Engine(models["qwen3"], slots=0, max_len=16)


def test_a_failed_step_ends_the_items_in_flight_and_the_engine_goes_on(models):
    """run_until_done (the path of batch_generate and, a step at a time, of the worker): a
    device step that raises ends every item in flight with the cause, and nothing hangs."""
    m = models["qwen3"]
    eng = Engine(m, slots=2, max_len=64)
    items = [eng.make_item(p, max_tokens=6, ignore_eos=True) for p in PROMPTS[:3]]
    for it in items:
        eng.add(it)
    real = eng.decoder.step
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected device failure")
        return real(*args, **kw)

    eng.decoder.step = failing
    eng.run_until_done()
    assert not eng.busy
    for it in items:
        with pytest.raises(EngineError, match="injected device failure"):
            it.handle.result(timeout=0)
    eng.decoder.step = real
    item = eng.make_item(PROMPTS[0], max_tokens=4)
    eng.add(item)
    eng.run_until_done()
    assert item.handle.result(0).tokens == m.generate(PROMPTS[0], max_tokens=4).tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_evaluated_layer_by_layer_gives_the_same_tokens(models, family):
    """The CPU policy evaluates large prefill calls layer by layer (``device.prefill_by_layer``),
    which bounds the memory they hold: forced on for every call (prompts in chunks too, which
    attend to what their slot holds) and off, the engine's tokens are ``Model.generate``'s."""
    m = models[family]
    refs = [m.generate(p, max_tokens=6, ignore_eos=True).tokens for p in PROMPTS]
    for by_layer in (1, 0):
        eng = Engine(m, slots=3, max_len=128, prefill_tokens=16)
        eng.encoder.by_layer = by_layer
        items = [eng.make_item(p, max_tokens=6, ignore_eos=True) for p in PROMPTS]
        for it in items:
            eng.add(it)
        eng.run_until_done()
        assert [it.handle.result(timeout=0).tokens for it in items] == refs


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_prompt_generates_the_same_layer_by_layer(models, family, monkeypatch):
    """``Model.generate`` evaluates a prompt of ``device.prefill_by_layer()`` tokens or more layer
    by layer (bounding the memory its forward holds): the tokens are those of the prompt's
    forward issued whole, also past Gemma's sliding window (16 in the test models)."""
    m = models[family]
    ids = [(7 * i) % 200 + 3 for i in range(300)]
    got = {}
    for threshold in (len(ids), 0):  # on every device, whatever its policy
        monkeypatch.setattr(slotinfer.device, "prefill_by_layer", lambda device=None, t=threshold: t)
        got[threshold] = m.generate(ids, max_tokens=5, ignore_eos=True).tokens
    assert got[len(ids)] == got[0]
