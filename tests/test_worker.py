"""The embedded worker's edges: bounded queues, closing, asyncio cancellation, serve_queue's
contract, and bad parameters that must fail their own request only -- never another's."""

import asyncio
import os
import queue
import threading
import time

import pytest

import slotinfer
import slotinfer.testing
from slotinfer.errors import EngineClosed, InvalidRequestError, QueueFull

LONG = dict(max_tokens=4000, ignore_eos=True)  # runs until cancelled (seconds), on these tiny models


def _until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _in_thread(fn, timeout=120.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return."""
    out = {}
    t = threading.Thread(target=lambda: out.update(value=fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} did not return within {timeout} s"
    return out.get("value")


@pytest.mark.parametrize("bad", [
    dict(top_logprobs=10**6), dict(top_logprobs=True), dict(top_logprobs=-1), dict(logprobs=1),
    dict(stop_token_ids=5), dict(stop_token_ids=[-1]), dict(stop_token_ids=["x"]), dict(stop=5),
    dict(on_token="print"),
])
def test_bad_parameters_fail_at_submit_and_touch_no_other_request(models, bad):
    m = models["qwen3"]
    want = m.generate("A good request", max_tokens=16, ignore_eos=True)
    with slotinfer.Inferencer(m, slots=4, max_len=128) as inf:
        good = inf.submit("A good request", max_tokens=16, ignore_eos=True)
        next(iter(good))  # running
        with pytest.raises(InvalidRequestError) as e:
            inf.submit("hi", max_tokens=4, **bad)
        assert next(iter(bad)) in str(e.value)
        got = good.result(timeout=60)
    assert (got.tokens, got.finish_reason) == (want.tokens, "length")
    [res] = m.batch_generate(["hi"], max_tokens=4, **bad)
    assert res.finish_reason == "error" and isinstance(res.error, InvalidRequestError)


def test_handle_has_its_id_at_submit(models):
    inf = slotinfer.Inferencer(models["qwen3"], slots=1, max_len=64, start=False)
    ids = [inf.submit("hello", max_tokens=2).id for _ in range(3)]
    assert len(set(ids)) == 3 and all(i > 0 for i in ids)
    inf.close()


@pytest.mark.parametrize("max_queue", [0, 2])
def test_a_request_cancelled_while_queued_ends_at_once(models, max_queue):
    with slotinfer.Inferencer(models["llama"], slots=1, max_len=4096, max_queue=max_queue) as inf:
        running = inf.submit("hello", **LONG)
        next(iter(running))
        queued = inf.submit("world", max_tokens=4)
        assert queued.cancel()
        assert queued.result(timeout=30).finish_reason == "cancelled"
        assert not running.done()
        running.cancel()
        assert running.result(timeout=30).finish_reason == "cancelled"


def test_max_queue_bounds_every_waiting_request(models):
    m = models["qwen3"]
    with slotinfer.Inferencer(m, slots=1, max_len=4096, max_queue=2) as inf:
        running = inf.submit("hello", **LONG)
        next(iter(running))
        queued = [inf.submit(f"request {i}", max_tokens=3, block=False) for i in range(2)]
        time.sleep(0.05)  # the worker has had every chance to move them out of the bound
        with pytest.raises(QueueFull, match="block=True"):
            inf.submit("one too many", max_tokens=3, block=False)
        t0 = time.monotonic()
        with pytest.raises(QueueFull, match="stayed full"):
            inf.submit("one too many", max_tokens=3, timeout=0.05)
        assert time.monotonic() - t0 >= 0.05
        assert inf.stats()["waiting"] == 2
        blocked = threading.Thread(target=lambda: inf.submit("waits for room", max_tokens=3).result(timeout=60))
        blocked.start()
        time.sleep(0.05)
        assert blocked.is_alive()  # no room until the running request ends
        running.cancel()
        blocked.join(timeout=60)
        assert not blocked.is_alive()
        assert [h.result(timeout=30).finish_reason for h in queued] == ["length"] * 2


def test_close_never_blocks_and_may_be_called_again(models):
    m = models["qwen3"]

    def bounded():
        with slotinfer.Inferencer(m, slots=1, max_len=64, max_queue=1) as inf:
            inf.generate("hi", max_tokens=2)
            inf.close()
            inf.close(drain=False)
        return True

    assert _in_thread(bounded)

    def never_started():  # close() still ends what was submitted (drained)
        inf = slotinfer.Inferencer(m, slots=1, max_len=64, max_queue=1, start=False)
        h = inf.submit("hi", max_tokens=3)
        inf.close()
        return h.result(timeout=30).finish_reason

    assert _in_thread(never_started) == "length"


def test_close_wakes_a_submit_waiting_for_room(models):
    m = models["llama"]
    inf = slotinfer.Inferencer(m, slots=1, max_len=4096, max_queue=1)
    running = inf.submit("hello", **LONG)
    next(iter(running))
    queued = inf.submit("queued", max_tokens=3)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(EngineClosed, inf.submit, "late", max_tokens=3)))
    t.start()
    time.sleep(0.05)
    _in_thread(lambda: inf.close(drain=False))
    t.join(timeout=30)
    assert not t.is_alive() and len(errors) == 1
    assert {running.result(timeout=30).finish_reason, queued.result(timeout=30).finish_reason} == {"cancelled"}


def test_submits_racing_close_are_never_lost(models):
    """Every submit either raises EngineClosed or returns a handle that ends."""
    m = models["qwen3"]
    for _ in range(5):
        inf = slotinfer.Inferencer(m, slots=8, max_len=64)
        handles, closed = [], []

        def producer():
            while True:
                try:
                    handles.append(inf.submit("x " * 4, max_tokens=1))
                except EngineClosed:
                    closed.append(1)
                    return

        threads = [threading.Thread(target=producer) for _ in range(4)]
        [t.start() for t in threads]
        time.sleep(0.005)  # hundreds of submits in flight when close starts, each drained: keep them short
        inf.close()
        [t.join(timeout=60) for t in threads]
        assert len(closed) == 4 and handles
        assert all(h.result(timeout=30).finish_reason == "length" for h in handles)


def _active(inf):
    return inf.stats()["active_slots"]


def test_cancelling_the_awaiting_task_cancels_the_request(models):
    m = models["llama"]
    seen = []

    async def main(inf):
        task = asyncio.create_task(inf.generate_async("hello", on_token=seen.append, **LONG))
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(inf.generate_async("again", **LONG), 0.05)
        h = inf.submit("a handle of our own", loop=asyncio.get_running_loop(), **LONG)
        waiter = asyncio.create_task(h._wait())
        await asyncio.sleep(0.05)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return h

    with slotinfer.Inferencer(m, slots=2, max_len=4096) as inf:
        h = _in_thread(lambda: asyncio.run(main(inf)))
        assert h.result(timeout=30).finish_reason == "cancelled"
        _in_thread(lambda: list(h))  # its stream ended too: iteration returns
        _until(lambda: _active(inf) == 0)
        assert inf.stats()["finished"] == 3
    assert len(seen) < 4000


def test_leaving_an_async_stream_early_cancels_it(models):
    m = models["qwen2"]

    async def main(inf):
        n = 0
        async for _ in inf.stream_async("hello", **LONG):
            n += 1
            if n == 3:
                break
        end = time.monotonic() + 60  # the loop keeps running: the stream is closed, not the loop
        while _active(inf) and time.monotonic() < end:
            await asyncio.sleep(0.005)
        return n, _active(inf), inf.stats()["decode_tokens"]

    with slotinfer.Inferencer(m, slots=2, max_len=4096) as inf:
        n, active, decoded = _in_thread(lambda: asyncio.run(main(inf)))
    budget = m.context_length - len(m.encode_prompt("hello"))
    assert (n, active) == (3, 0) and decoded < budget // 2


def test_an_abandoned_async_stream_fails_no_one_else(models):
    """A handle whose event loop closed while it ran: others finish, and it still ends."""
    m = models["qwen3"]
    want = m.generate("unrelated", max_tokens=40, ignore_eos=True)

    async def abandon(inf):
        h = inf.submit("hello", loop=asyncio.get_running_loop(), max_tokens=40, ignore_eos=True)
        await asyncio.sleep(0.01)
        return h

    with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
        other = inf.submit("unrelated", max_tokens=40, ignore_eos=True)
        abandoned = _in_thread(lambda: asyncio.run(abandon(inf)))
        got = other.result(timeout=60)
        assert abandoned.result(timeout=60).finish_reason == "length"
    assert (got.tokens, got.finish_reason) == (want.tokens, "length")


def test_async_submit_waits_for_room_without_blocking_the_loop(models):
    m = models["llama"]

    async def main(inf):
        running = inf.submit("hello", **LONG)
        while not running.done() and inf.stats()["active_slots"] == 0:
            await asyncio.sleep(0.001)
        inf.submit("fills the queue", max_tokens=3)
        waiting = asyncio.create_task(inf.generate_async("waits for room", max_tokens=3))
        await asyncio.sleep(0.05)  # with a blocked loop we would not be back here before room came
        assert not waiting.done() and not running.done()
        with pytest.raises(QueueFull):
            await inf.generate_async("no room", max_tokens=3, block=False)
        running.cancel()
        return (await waiting).finish_reason

    with slotinfer.Inferencer(m, slots=1, max_len=4096, max_queue=1) as inf:
        assert _in_thread(lambda: asyncio.run(main(inf))) == "length"


class _SlowQueue(queue.Queue):
    def put(self, item, block=True, timeout=None):
        time.sleep(0.002)
        super().put(item, block, timeout)


def test_serve_queue_answers_every_request_once_and_the_sentinel_last(models):
    m = models["qwen3"]
    reqs = [{"id": "no prompt", "max_tokens": 4}, {"id": "bad", "prompt": "x", "top_logprobs": 10**6},
            slotinfer.Request("a request", {"max_tokens": 3}, id="req"), "a bare prompt"]
    reqs += [{"id": f"p{i}", "prompt": f"prompt {i}", "max_tokens": 1 + i % 3} for i in range(12)]
    in_q, out_q = queue.Queue(), _SlowQueue()
    for r in reqs:
        in_q.put(r)
    in_q.put(None)
    with slotinfer.Inferencer(m, slots=3, max_len=64) as inf:
        _in_thread(lambda: inf.serve_queue(in_q, out_q))
        after = inf.generate("still serving", max_tokens=2)
    out = [out_q.get_nowait() for _ in range(out_q.qsize())]
    assert out[-1] is None and None not in out[:-1]  # nothing after the sentinel
    by_id = {c.request_id: c for c in out[:-1]}
    assert len(out) - 1 == len(reqs) == len(by_id)  # one completion each
    assert 3 in by_id and 3 not in [getattr(r, "id", None) for r in reqs]  # the bare prompt: its position in in_q
    assert isinstance(by_id["no prompt"].error, InvalidRequestError) and "'prompt'" in str(by_id["no prompt"].error)
    assert by_id["bad"].finish_reason == "error" and isinstance(by_id["bad"].error, InvalidRequestError)
    assert by_id["req"].tokens == m.generate("a request", max_tokens=3).tokens
    assert all(by_id[f"p{i}"].finish_reason in ("length", "stop") for i in range(12))
    assert after.finish_reason in ("length", "stop")


@pytest.mark.parametrize("family", slotinfer.testing.FAMILIES)
def test_a_model_used_first_by_the_worker_thread(model_dir, family):
    """Nothing a freshly loaded model holds may still be lazy on the loading thread's stream:
    the Inferencer's first step runs on its worker thread, where that stream does not exist."""
    m = slotinfer.load(model_dir(family))
    with slotinfer.Inferencer(m, slots=2, max_len=64) as inf:
        got = inf.submit("hello there", max_tokens=6, ignore_eos=True).result(timeout=60)
    assert got.tokens == m.generate("hello there", max_tokens=6, ignore_eos=True).tokens


def _os_threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _worker_of(inf) -> threading.Thread:
    seen = []
    inf.submit("hi", max_tokens=2, ignore_eos=True,
               on_token=lambda e: seen.append(threading.current_thread())).result(timeout=60)
    return seen[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="counts threads through Linux's /proc")
def test_closed_inferencers_leave_no_threads_behind(models):
    """MLX serves every stream with a thread that lives as long as the process, and each thread
    that runs ops gets streams of its own: a program that opens and closes Inferencers (one per
    job, say) must not grow by a few threads at each one."""
    m = models["qwen3"]

    def one():
        with slotinfer.Inferencer(m, slots=2, max_len=64) as inf:
            inf.generate("hi", max_tokens=3, ignore_eos=True)

    one()
    before = _os_threads()
    for _ in range(4):
        one()
    assert _os_threads() <= before


def test_a_closed_inferencers_worker_serves_the_next_and_open_ones_never_share(models):
    m = models["qwen3"]
    with slotinfer.Inferencer(m, slots=1, max_len=64) as a, slotinfer.Inferencer(m, slots=1, max_len=64) as b:
        wa, wb = _worker_of(a), _worker_of(b)
        assert wa is not wb and wa is not threading.current_thread()
    with slotinfer.Inferencer(m, slots=1, max_len=64) as c:
        assert _worker_of(c) in (wa, wb)


def test_a_loop_that_raises_is_reported_and_its_worker_serves_on(models, monkeypatch):
    m = models["qwen3"]
    reported = []
    monkeypatch.setattr("sys.excepthook", lambda *exc: reported.append(exc[1]))
    broken = slotinfer.Inferencer(m, slots=1, max_len=64, start=False)
    monkeypatch.setattr(broken, "_turn", lambda: 1 / 0)
    broken.start()
    _in_thread(lambda: broken.close(timeout=60))
    assert broken._done.is_set() and isinstance(reported[0], ZeroDivisionError)
    with slotinfer.Inferencer(m, slots=1, max_len=64) as inf:
        assert inf.generate("hi", max_tokens=3, ignore_eos=True).tokens == \
            m.generate("hi", max_tokens=3, ignore_eos=True).tokens
