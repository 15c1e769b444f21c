"""Classification on the Inferencer's worker: the results of Model.classify, a unit of work between two
engine steps, cancelled between units, ended with the Inferencer; and classify() interrupted keeps what
its queued work finished."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

import slotinfer
from slotinfer.classify import classify
from slotinfer.errors import Cancelled, EngineClosed, EngineError, InvalidRequestError

LABELS = ["yes", "no", "very good", "not sure at all"]  # single- and multi-token


@pytest.fixture(scope="module")
def model(model_dir):
    return slotinfer.load(model_dir("qwen3"))


def _texts(n, seed=0):
    rng = random.Random(seed)
    words = ["good", "bad", "food", "day", "nice", "the", "a", "movie", "was", "not"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(n)]


@pytest.mark.parametrize("kw", [
    dict(labels=LABELS, prefix="Q: ", label_prefix=" "),
    dict(labels=LABELS, temperature=1.5, seed=4),
    dict(return_logits=True, prefix="Review: "),
    dict(temperature=0.8, top_k=20, seed=9),
])
def test_the_workers_results_are_model_classifys_beside_running_streams(model, kw):
    texts = _texts(30)
    prompts = [[random.Random(i).randrange(3, 500) for _ in range(9)] for i in range(3)]
    want_gen = [model.generate(p, max_tokens=20, ignore_eos=True).text for p in prompts]
    want = classify(model, texts, token_budget=24, **kw)
    with slotinfer.Inferencer(model, slots=2, max_len=64, prefill_tokens=24) as inf:
        streams = [inf.submit(p, max_tokens=20, ignore_eos=True) for p in prompts]
        got = inf.submit_classify(texts, **kw)
        assert [h.result().text for h in streams] == want_gen
        got = got.result()
    for w, g in zip(want, got, strict=True):
        assert (g.label, g.token, g.scores, g.prompt_tokens) == (w.label, w.token, w.scores, w.prompt_tokens)
        if w.logits is not None:
            np.testing.assert_array_equal(g.logits, w.logits)


def test_a_stream_waits_at_most_one_batch_per_token(model):
    """Between two tokens of a running stream, the worker finishes at most one classify batch (one unit
    of work each, with labels of one token in this tokenizer); and the classification advances while
    the stream runs."""
    texts = ["good food was not bad"] * 200  # equal lengths: batches of budget // length prompts
    log = []
    with slotinfer.Inferencer(model, slots=2, max_len=128, prefill_tokens=16) as inf:
        h = inf.submit("a", max_tokens=60, ignore_eos=True, on_token=lambda ev: log.append("t"))
        job = inf.submit_classify(texts, labels=["a", "x"], on_result=lambda i, r: log.append("c"))
        h.result()
        job.result()
    per_batch = 16 // len(model.encode_prompt(texts[0]))
    tokens = [i for i, x in enumerate(log) if x == "t"]
    between = [log[a:b].count("c") for a, b in zip(tokens, tokens[1:])]
    assert max(between) <= per_batch, between
    assert sum(between) >= 10 * per_batch, between  # interleaved, not run before or after the stream


def test_a_cancelled_classification_stops_between_units_and_the_next_runs(model):
    texts = _texts(400, seed=1)
    done = []
    started, gate = threading.Event(), threading.Event()
    with slotinfer.Inferencer(model, slots=1, max_len=64, prefill_tokens=16) as inf:
        def on_result(i, r):
            done.append(i)
            if len(done) == 1:
                job.cancel()

        # the worker waits in this request's callback until both jobs are submitted
        inf.submit("a", max_tokens=1, on_token=lambda ev: (started.set(), gate.wait(30)))
        started.wait(30)
        job = inf.submit_classify(texts, labels=LABELS, on_result=on_result)
        queued = inf.submit_classify(texts, labels=LABELS)
        queued.cancel()  # waiting behind the first, it ends without running
        gate.set()
        with pytest.raises(Cancelled):
            job.result(timeout=60)
        with pytest.raises(Cancelled):
            queued.result(timeout=60)
        assert len(done) < 40  # the batch it was in, and at most one queued after it
        assert [r.label for r in inf.classify(texts[:5], labels=LABELS)] == \
            [r.label for r in classify(model, texts[:5], labels=LABELS, token_budget=16)]


def test_close_finishes_or_cancels_classifications(model):
    texts = _texts(200, seed=2)
    inf = slotinfer.Inferencer(model, slots=1, max_len=64, prefill_tokens=16)
    job = inf.submit_classify(texts, labels=LABELS)
    inf.close()  # drain: it runs to the end
    assert len(job.result(timeout=0)) == 200 and all(r.label in LABELS for r in job.result())
    with pytest.raises(EngineClosed):
        inf.submit_classify(texts, labels=LABELS)
    inf = slotinfer.Inferencer(model, slots=1, max_len=64, prefill_tokens=16)
    job = inf.submit_classify(texts, labels=LABELS)
    inf.close(drain=False)
    with pytest.raises(Cancelled):
        job.result(timeout=0)


def test_bad_requests_raise_at_submit_and_a_failing_callback_fails_its_job_alone(model):
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf:
        with pytest.raises(InvalidRequestError, match="duplicate label"):
            inf.submit_classify(["x"], labels=["a", "a"])

        def boom(i, r):
            raise KeyboardInterrupt

        bad = inf.submit_classify(_texts(5), labels=LABELS, on_result=boom)
        with pytest.raises(EngineError, match="KeyboardInterrupt"):
            bad.result(timeout=60)
        assert inf.generate("a", max_tokens=3, ignore_eos=True).finish_reason == "length"
        assert len(inf.classify(_texts(5), labels=LABELS)) == 5


def test_await_a_classification(model):
    async def main(inf):
        return await inf.submit_classify(["good", "bad"], labels=LABELS)

    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf:
        got = asyncio.run(main(inf))
    assert [r.label for r in got] == [r.label for r in classify(model, ["good", "bad"], labels=LABELS,
                                                                token_budget=inf.engine.encoder.budget)]


def test_interrupted_classify_hands_on_the_batches_already_queued(model):
    """A KeyboardInterrupt (Ctrl-C) inside classify: the batches whose work was queued whole are
    finished and handed to on_result before it propagates, each prompt once."""
    texts = ["good food was not bad"] * 60
    got = []

    def on_result(i, r):
        got.append(i)
        if len(got) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        classify(model, texts, labels=["a", "x"], token_budget=30, on_result=on_result)
    per_batch = 30 // len(model.encode_prompt(texts[0]))
    assert len(got) == len(set(got)) == 2 * per_batch  # the batch being written, and the one queued after it
