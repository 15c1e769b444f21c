"""Whatever one request carries fails that request alone; the worker outlives it, and what the
engine keeps (closed Inferencers, compiled step variants) stays bounded."""

import asyncio
import gc
import threading
import time
import weakref

import mlx.core as mx
import numpy as np
import pytest

import slotinfer
from slotinfer.kv.views import SequenceCache
from slotinfer.engine.engine import Engine
from slotinfer.errors import EngineError, QueueFull
from slotinfer.engine.item_processor import ItemProcessor, State

PROMPT = "Hello there, how are you today?"
OTHER = "The quick brown fox jumps over the lazy dog."
LONG = dict(max_tokens=4000, ignore_eos=True)  # runs until cancelled, on these tiny models


class _Custom(BaseException):
    """A BaseException no one catches by accident."""


RAISED = [ValueError("bad"), KeyboardInterrupt(), SystemExit(3), asyncio.CancelledError(), GeneratorExit(),
          _Custom("custom"), MemoryError()]


def _in_thread(fn, timeout=120.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed back to the test
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} did not return within {timeout} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _raiser(exc, after=2):
    seen = []

    def on_token(ev):
        seen.append(ev)
        if len(seen) >= after:
            raise exc

    return on_token


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_a_callback_raising_anything_fails_its_request_only(models, exc):
    m = models["qwen3"]
    want = m.generate(OTHER, max_tokens=12, ignore_eos=True).tokens

    def run():
        with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
            bystander = inf.submit(OTHER, max_tokens=12, ignore_eos=True)
            bad = inf.submit(PROMPT, max_tokens=12, ignore_eos=True, on_token=_raiser(exc))
            with pytest.raises(EngineError) as e:
                bad.result(timeout=60)
            assert type(exc).__name__ in str(e.value) and "on_token" in str(e.value)
            assert bystander.result(timeout=60).tokens == want
            # the worker serves on
            assert inf.generate(OTHER, max_tokens=12, ignore_eos=True).tokens == want
            list(bad)  # its stream ended too (else this hangs)

    _in_thread(run)


def test_a_done_callback_raising_a_base_exception_fails_no_one_else(models):
    """A done callback on a request's future runs on the worker when it ends (``serve_queue``
    adds one); one that raises anything touches no other request and not the worker."""
    m = models["qwen3"]
    want = m.generate(OTHER, max_tokens=10, ignore_eos=True).tokens

    def boom(_):
        raise _Custom("from a done callback")

    def run():
        with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
            bystander = inf.submit(OTHER, max_tokens=10, ignore_eos=True)
            h = inf.submit(PROMPT, max_tokens=3, ignore_eos=True)
            h._future.add_done_callback(boom)
            assert len(h.result(timeout=60).tokens) == 3
            assert bystander.result(timeout=60).tokens == want
            assert inf.generate(OTHER, max_tokens=10, ignore_eos=True).tokens == want

    _in_thread(run)


def test_delivery_to_a_closed_event_loop_fails_no_one_else(models):
    m = models["qwen3"]
    want = m.generate(OTHER, max_tokens=10, ignore_eos=True).tokens
    loop = asyncio.new_event_loop()  # open at submit (a closed one is refused there), closed before delivery

    def run():
        with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
            bystander = inf.submit(OTHER, max_tokens=10, ignore_eos=True)
            orphan = inf.submit(PROMPT, max_tokens=6, ignore_eos=True, loop=loop)
            loop.close()
            assert len(orphan.result(timeout=60).tokens) == 6
            assert bystander.result(timeout=60).tokens == want

    _in_thread(run)


class _BrokenDetokenizer:
    def add(self, token):
        raise _Custom("the detokenizer failed")

    def flush(self):
        return ""


def test_an_item_failing_in_the_host_bookkeeping_fails_alone(models):
    """A step's host side (append, detokenize, stop strings) that raises for one row ends that
    row's request with the cause; the other rows of the same step carry on."""
    m = models["qwen3"]
    eng = Engine(m, slots=3, max_len=128)
    good = [eng.make_item(p, max_tokens=8, ignore_eos=True, stop=["zz"]) for p in (PROMPT, OTHER)]
    bad = eng.make_item(PROMPT, max_tokens=8, ignore_eos=True, stop=["zz"])
    bad.detok = _BrokenDetokenizer()
    for it in (good[0], bad, good[1]):
        eng.add(it)
    eng.run_until_done()
    with pytest.raises(EngineError, match="detokenizer failed"):
        bad.handle.result(timeout=0)
    for it, p in zip(good, (PROMPT, OTHER)):
        assert it.handle.result(timeout=0).tokens == m.generate(p, max_tokens=8, ignore_eos=True, stop=["zz"]).tokens
    assert sorted(eng.items.free) == [0, 1, 2]


def test_a_callback_submitting_to_a_full_queue_never_deadlocks_the_worker(models):
    m = models["qwen3"]
    errors = []

    def run():
        with slotinfer.Inferencer(m, slots=1, max_len=4096, max_queue=1) as inf:
            def resubmit(ev):
                try:
                    inf.submit("again", max_tokens=2)  # the queue holds `queued` already
                except QueueFull as e:
                    errors.append(e)
                raise StopIteration  # and end this request

            queued = None
            first = inf.submit(PROMPT, max_tokens=500, ignore_eos=True,
                               on_token=lambda ev: queued is not None and resubmit(ev))
            queued = inf.submit(OTHER, max_tokens=2, ignore_eos=True)
            with pytest.raises(EngineError, match="StopIteration"):
                first.result(timeout=60)
            assert len(queued.result(timeout=60).tokens) == 2

    _in_thread(run)
    assert errors and "worker" in str(errors[0])


def test_a_dead_worker_ends_every_pending_and_future_handle(models, monkeypatch):
    """Should the loop itself ever fail (a bug, injected here into the worker's step), no
    request hangs: those in flight and queued, and any submitted later, end with EngineError,
    each failed by a move of the item processor like every other end."""
    m = models["qwen3"]
    reported, moves, move = [], [], ItemProcessor.move
    monkeypatch.setattr("sys.excepthook", lambda *exc: reported.append(exc[1]))
    monkeypatch.setattr(ItemProcessor, "move", lambda self, it, to: (moves.append((it.id, to)), move(self, it, to))[1])
    inf = slotinfer.Inferencer(m, slots=1, max_len=4096, start=False)
    handles = [inf.submit(p, **LONG) for p in (PROMPT, OTHER, "x")]
    real, steps = inf.engine.step_or_fail, []

    def failing():
        steps.append(1)
        if len(steps) == 3:
            raise _Custom("injected bug in the loop")
        real()

    monkeypatch.setattr(inf.engine, "step_or_fail", failing)
    inf.start()
    for h in handles:
        with pytest.raises(EngineError, match="injected bug"):
            h.result(timeout=60)
        list(h)  # its stream ended too
    later = inf.submit(PROMPT, max_tokens=3)
    with pytest.raises(EngineError, match="injected bug"):
        later.result(timeout=10)
    ends = {h.id: [to for rid, to in moves if rid == h.id] for h in [*handles, later]}
    assert ends[handles[0].id] == [State.PREFILLING, State.DECODING, State.FAILED]
    assert [ends[h.id][-1] for h in handles[1:]] == [State.FAILED] * 2 and ends[later.id] == [State.FAILED]
    _in_thread(lambda: inf.close(timeout=30))
    assert inf._done.is_set() and isinstance(reported[0], _Custom)
    with slotinfer.Inferencer(m, slots=1, max_len=64) as again:  # the worker thread serves on
        assert again.generate(PROMPT, max_tokens=3).tokens == m.generate(PROMPT, max_tokens=3).tokens


def _collectable(make) -> bool:
    ref = make()
    for _ in range(50):
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.02)
    return False


def test_a_closed_inferencer_is_freed_with_its_kv_cache(models):
    m = models["qwen3"]

    def one():
        inf = slotinfer.Inferencer(m, slots=2, max_len=512)
        inf.generate(PROMPT, max_tokens=3, on_token=lambda ev: None)
        inf.close()
        assert inf._done.is_set()  # its worker left the loop (and waits, idle, for the next one)
        return weakref.ref(inf)

    assert _collectable(one)
    gc.collect()
    before = mx.get_active_memory()
    for _ in range(5):
        assert _collectable(one)
    kv = 2 * 512 * 2 * m.config.num_layers  # far less than one table: no table is left behind
    assert mx.get_active_memory() - before < kv


def test_an_inferencer_dropped_without_close_finishes_its_requests_and_is_freed(models):
    m = models["qwen3"]
    held = {}

    def one():
        inf = slotinfer.Inferencer(m, slots=1, max_len=256)
        held["h"] = inf.submit(OTHER, max_tokens=40, ignore_eos=True)
        return weakref.ref(inf)

    ref = one()
    assert len(held["h"].result(timeout=60).tokens) == 40  # dropped, it still finished what it was given
    assert _collectable(lambda: ref)


def test_a_never_started_inferencer_dropped_ends_its_requests(models):
    held = {}

    def one():
        inf = slotinfer.Inferencer(models["qwen3"], slots=1, max_len=64, start=False)
        held["h"] = inf.submit(PROMPT, max_tokens=2)
        return weakref.ref(inf)

    assert _collectable(one)
    with pytest.raises(slotinfer.errors.EngineClosed, match="close"):
        held["h"].result(timeout=10)


def _reference_top(m, prompt, tokens, n):
    ids = m.encode_prompt(prompt)
    seq = ids + tokens
    h = m.net(mx.array([seq]), SequenceCache(m.config.num_layers))
    logits = m.net.head(h[0, len(ids) - 1: len(seq) - 1]).astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return [list(np.argsort(-row)[:n]) for row in ref], ref


def test_distinct_top_logprobs_compile_a_bounded_number_of_step_variants(models):
    m = models["qwen2"]
    vocab = m.config.vocab_size
    values = list(range(1, 41)) + [vocab // 2, vocab - 1, vocab]
    with slotinfer.Inferencer(m, slots=2, max_len=64) as inf:
        got = {}
        for v in values:  # two at a time, so rows of different asks share steps
            got[v] = inf.submit(PROMPT, max_tokens=3, ignore_eos=True, top_logprobs=v)
        got = {v: h.result(timeout=60) for v, h in got.items()}
        variants = inf.engine.decoder.variants
    assert variants <= 6, f"{variants} compiled decode variants for {len(values)} distinct top_logprobs"
    want = m.generate(PROMPT, max_tokens=3, ignore_eos=True).tokens
    for v in (1, 3, 7, 20, 21, 40):
        c = got[v]
        assert c.tokens == want and [len(t) for t in c.top_logprobs] == [v] * 3
        ids, ref = _reference_top(m, PROMPT, c.tokens, v)
        assert [[i for i, _ in t] for t in c.top_logprobs] == ids
        np.testing.assert_allclose([[x for _, x in t] for t in c.top_logprobs],
                                   [ref[i, ids[i]] for i in range(3)], atol=2e-4)
    assert [len(t) for t in got[vocab].top_logprobs] == [vocab] * 3


def test_prompts_of_many_lengths_keep_a_bounded_number_of_compiled_op_variants(models):
    """Every prefill shape traces the model's compiled ops (the MLP's activation, the attention's
    softmax) anew: a thread keeps the MAX_VARIANTS latest, whatever lengths the traffic brings, and a
    shape traced again gives the tokens it gave before."""
    from slotinfer._compile import MAX_VARIANTS

    m = models["qwen3"]
    act = m.net.model.layers[0].mlp.act  # the op a [rows, width, hidden] prefill runs in every layer
    words = "one two three four five six seven eight nine ten".split()
    prompts = [" ".join(words[j % 10] for j in range(n)) for n in range(1, MAX_VARIANTS + 20)]
    traced, kept = act.traced, act.variants  # other threads' (earlier tests') variants stay as they are
    # one row a prefill, all of the prompt (no prefix cache): a width per prompt length
    with slotinfer.Inferencer(m, slots=1, max_len=512, prefix_cache_bytes=0) as inf:
        first = [inf.generate(p, max_tokens=2, temperature=0).tokens for p in prompts]
        assert act.traced - traced > MAX_VARIANTS  # the traffic brought more shapes than are kept
        assert act.variants - kept <= MAX_VARIANTS  # the worker thread's, however many shapes came
        again = [inf.generate(p, max_tokens=2, temperature=0).tokens for p in prompts[:8]]  # evicted, traced again
        assert act.variants - kept <= MAX_VARIANTS
    assert again == first[:8]


def test_stats_count_accepted_requests_and_refusals_apart(models):
    m = models["qwen3"]

    def run():
        with slotinfer.Inferencer(m, slots=1, max_len=4096, max_queue=1) as inf:
            running = inf.submit(PROMPT, **LONG)
            next(iter(running))
            queued = inf.submit(OTHER, max_tokens=2)
            with pytest.raises(QueueFull):
                inf.submit("x", max_tokens=2, block=False)
            with pytest.raises(QueueFull):
                inf.submit("x", max_tokens=2, timeout=0.05)

            async def refused_async():
                with pytest.raises(QueueFull):
                    await inf.generate_async("x", max_tokens=2, block=False)
                task = asyncio.ensure_future(inf.generate_async("x", max_tokens=2))
                await asyncio.sleep(0.05)  # waiting for room
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            asyncio.run(refused_async())
            st = inf.stats()
            assert (st["submitted"], st["refused"]) == (2, 4)
            running.cancel()
            queued.result(timeout=60)

    _in_thread(run)
