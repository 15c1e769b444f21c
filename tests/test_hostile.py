"""Acceptance: one Inferencer under hostile concurrent producers.

Threads and an asyncio task submit at once: valid requests, invalid ones (bad values,
unknown keywords), callbacks raising every kind of exception, cancellations at random
points, and a close racing the submits.  Whatever they do, every accepted request ends
exactly once, greedy bystanders get the tokens of their solo run, the worker lives until
close, slots and compiled variants stay bounded, and the closed Inferencer is freed.
"""

import asyncio
import gc
import os
import re
import subprocess
import sys
import threading
import time
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotinfer
from slotinfer.cli.bench import raising_callback
from slotinfer.errors import EngineClosed, EngineError, QueueFull

PROMPTS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.", "x",
           "Les enfants jouent dans le jardin."]
GREEDY = dict(max_tokens=6, ignore_eos=True)
SLOTS, MAX_LEN = 2, 64
# row layouts (1 row at slot 0 or gathered, 2 rows) x greedy x sort x repetition penalty x logit adjustments x
# token masks x logprob counts, one span bucket at MAX_LEN 64
VARIANTS_BOUND = 3 * 2 * 2 * 2 * 2 * 2 * 6
# about 0.5 s an example on 2 CPU cores (80: ~45 s of the suite); SLOTINFER_HOSTILE_EXAMPLES=200 for a longer run
EXAMPLES = int(os.environ.get("SLOTINFER_HOSTILE_EXAMPLES", "80"))


class _Custom(BaseException):
    pass


RAISED = [ValueError, KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit, MemoryError,
          StopIteration, _Custom]
INVALID = [dict(temperature=-1.0), dict(top_logprobs=-1), dict(unknown_keyword=1), dict(stop=5), dict(max_tokens=0),
           dict(top_p=2.0), dict(on_token="print"), dict(seed=-3), dict(logprobs="yes"), dict(regex="(("),
           dict(json_schema={"type": "nothing"}), dict(logit_bias={"-1": 2}), dict(choice="yes")]

bystander = st.tuples(st.just("bystander"), st.sampled_from(range(len(PROMPTS))))
sampled = st.tuples(st.just("sampled"), st.fixed_dictionaries({
    "max_tokens": st.integers(1, 8), "temperature": st.sampled_from([0.0, 0.7]), "top_k": st.sampled_from([0, 3]),
    "top_logprobs": st.integers(0, 576), "seed": st.integers(0, 2**32 - 1), "stop": st.sampled_from([None, ["a"]]),
    "repetition_penalty": st.sampled_from([1.0, 1.2]), "frequency_penalty": st.sampled_from([0.0, 0.5]),
    "regex": st.sampled_from([None, "[a-c]+"])}))
invalid = st.tuples(st.just("invalid"), st.sampled_from(INVALID))
raising = st.tuples(st.just("raise"), st.sampled_from(RAISED), st.integers(1, 4))
cancel = st.tuples(st.just("cancel"), st.sampled_from(["at once", "first token", "later"]))
action = st.one_of(bystander, sampled, invalid, raising, cancel)


class _Ledger:
    """What producers did: accepted handles with their kind, and each handle's end count."""

    def __init__(self):
        self.lock = threading.Lock()
        self.accepted = []  # (kind, detail, handle)
        self.ends = {}

    def add(self, kind, detail, h):
        with self.lock:
            self.accepted.append((kind, detail, h))
            self.ends[h.id] = 0

        def ended(_):
            with self.lock:
                self.ends[h.id] += 1

        h._future.add_done_callback(ended)


def _submit(inf, ledger, act, submit=None):
    submit = submit or inf.submit
    kind = act[0]
    if kind == "bystander":
        params, detail = dict(GREEDY), act[1]
    elif kind == "sampled":
        params, detail = {k: v for k, v in act[1].items() if v is not None}, None
    elif kind == "invalid":
        params, detail = {"max_tokens": 2, **act[1]}, None
    elif kind == "raise":
        params, detail = dict(max_tokens=6, ignore_eos=True, on_token=raising_callback(act[1], act[2])), act[1]
    else:
        params, detail = dict(max_tokens=40, ignore_eos=True), act[1]
    prompt = PROMPTS[act[1]] if kind == "bystander" else PROMPTS[len(kind) % len(PROMPTS)]
    try:
        h = submit(prompt, **params)
    except EngineClosed:
        return None  # close won the race: refused, never accepted
    except (ValueError, TypeError) as e:
        assert kind == "invalid", f"a valid {kind} request was refused: {e!r}"
        return None
    assert kind != "invalid", f"invalid parameters {act[1]} were accepted"
    ledger.add(kind, detail, h)
    if kind == "cancel":
        if detail == "at once":
            h.cancel()
        elif detail == "first token":
            next(iter(h), None)
            h.cancel()
    return h


def _producer(inf, ledger, actions, errors):
    try:
        later = []
        for act in actions:
            h = _submit(inf, ledger, act)
            if h is not None and act[0] == "cancel" and act[1] == "later":
                later.append(h)
        for h in later:
            h.cancel()
    except BaseException as e:  # noqa: BLE001 -- reported by the test
        errors.append(e)


def _async_producer(inf, ledger, actions, errors):
    async def main():
        tasks = []
        for act in actions:
            if act[0] == "cancel":  # an awaiting task cancelled at a random point cancels its request
                task = asyncio.ensure_future(inf.generate_async(PROMPTS[0], max_tokens=40, ignore_eos=True))
                await asyncio.sleep(0 if act[1] == "at once" else 0.005)
                task.cancel()
                tasks.append(task)
                continue

            async def one(act=act):
                try:
                    return _submit(inf, ledger, act, submit=lambda p, **kw: inf.submit(p, loop=loop, **kw))
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks, return_exceptions=True)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
    finally:
        loop.close()  # the worker may still deliver to its handles: to a closed loop


@pytest.fixture(scope="module")
def solo(models):
    m = models["qwen3"]
    return m, [m.generate(p, **GREEDY).tokens for p in PROMPTS]


@settings(max_examples=EXAMPLES, deadline=None)
@given(plans=st.lists(st.lists(action, max_size=5), min_size=4, max_size=4),
       close_after=st.one_of(st.none(), st.floats(0, 0.05)), drain=st.booleans(),
       max_queue=st.sampled_from([0, 3]))
def test_one_inferencer_survives_hostile_producers(solo, plans, close_after, drain, max_queue):
    m, want = solo
    ledger, errors = _Ledger(), []
    inf = slotinfer.Inferencer(m, slots=SLOTS, max_len=MAX_LEN, max_queue=max_queue)
    threads = [threading.Thread(target=_producer, args=(inf, ledger, p, errors), daemon=True) for p in plans[:3]]
    threads.append(threading.Thread(target=_async_producer, args=(inf, ledger, plans[3], errors), daemon=True))
    for t in threads:
        t.start()
    if close_after is not None:  # close races the submits
        time.sleep(close_after)
        inf.close(drain=drain, timeout=60)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a producer hangs"
    assert not errors, errors
    if close_after is None:
        assert not inf._done.is_set(), "the worker left its loop before close"
        again = inf.submit(PROMPTS[0], **GREEDY)  # the worker still serves
        assert again.result(timeout=60).tokens == want[0]
        ledger.add("bystander", 0, again)
        inf.close(drain=drain, timeout=60)
    assert inf._done.is_set(), "close did not end the worker's loop"

    for kind, detail, h in ledger.accepted:
        assert h.done(), f"an accepted {kind} request never ended"
        list(h)  # its stream ended too
        try:
            c = h.result(timeout=0)
        except EngineError as e:
            assert kind == "raise" and detail.__name__ in str(e), f"{kind} failed: {e!r}"
            continue
        if kind == "bystander":
            if c.finish_reason == "cancelled":  # close(drain=False) cut it short
                assert not drain and c.tokens == want[detail][:len(c.tokens)]
            else:
                assert c.tokens == want[detail]
    assert all(n == 1 for n in ledger.ends.values()), "a request ended more than once"
    st_ = inf.stats()
    # the ledger misses only the awaiting tasks' requests (cancelled at random points), counted all the same
    assert st_["submitted"] == st_["finished"] >= len(ledger.accepted)
    eng = inf.engine
    assert sorted(eng.items.free) == list(range(SLOTS)) and not any(eng.items.by_slot) and not eng.busy
    assert eng.decoder.variants <= VARIANTS_BOUND

    ref = weakref.ref(inf)
    del inf, eng, threads
    for _ in range(100):
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.01)
    assert ref() is None, "a closed Inferencer is still referenced"


def test_queue_full_is_the_only_refusal_of_a_valid_request(solo):
    """With a bound and no blocking, a valid request is accepted or refused with QueueFull; the
    refusals are counted apart from the accepted."""
    m, _ = solo
    with slotinfer.Inferencer(m, slots=1, max_len=4096, max_queue=1) as inf:
        running = inf.submit(PROMPTS[0], max_tokens=4000, ignore_eos=True)
        next(iter(running))
        accepted, refused = [running], 0
        for _ in range(5):
            try:
                accepted.append(inf.submit(PROMPTS[1], max_tokens=2, block=False))
            except QueueFull:
                refused += 1
        running.cancel()
        for h in accepted:
            h.result(timeout=60)
        st_ = inf.stats()
    assert (st_["submitted"], st_["refused"]) == (len(accepted), refused) == (2, 4)


@pytest.mark.slow  # the CLI's soak run as a subprocess
def test_the_soak_command_prints_rss_and_variants(tmp_path):
    """``slotinfer bench --soak N``: a line of RSS and compiled variants every N/10 requests,
    then how every request ended."""
    env = {**os.environ, "SLOTINFER_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "slotinfer", "bench", "--soak", "60"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\s*(\d+) requests\s+RSS\s+([\d.]+) MiB\s+compiled step variants (\d+)$", proc.stdout, re.M)
    assert [int(n) for n, _, _ in rows] == list(range(6, 61, 6))
    assert all(float(rss) > 0 and int(v) <= VARIANTS_BOUND for _, rss, v in rows) and int(rows[-1][2]) > 0
    ended = re.search(r"^ended: .*submitted (\d+), refused 0, finished (\d+)$", proc.stdout, re.M)
    assert ended and ended[1] == ended[2]
