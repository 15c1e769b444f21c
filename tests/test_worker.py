"""The embedded worker's edges: bounded queues, closing, asyncio cancellation, serve_queue's
contract, and bad parameters that must fail their own request only -- never another's."""

import pytest

import slotinfer
import slotinfer.testing
from slotinfer.errors import InvalidRequestError


@pytest.mark.parametrize("bad", [
    dict(top_logprobs=10**6), dict(top_logprobs=True), dict(top_logprobs=-1), dict(logprobs=1),
    dict(stop_token_ids=5), dict(stop_token_ids=[-1]), dict(stop_token_ids=["x"]), dict(stop=5),
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


@pytest.mark.parametrize("family", slotinfer.testing.FAMILIES)
def test_a_model_used_first_by_the_worker_thread(model_dir, family):
    """Nothing a freshly loaded model holds may still be lazy on the loading thread's stream:
    the Inferencer's first step runs on its worker thread, where that stream does not exist."""
    m = slotinfer.load(model_dir(family))
    with slotinfer.Inferencer(m, slots=2, max_len=64) as inf:
        got = inf.submit("hello there", max_tokens=6, ignore_eos=True).result(timeout=60)
    assert got.tokens == m.generate("hello there", max_tokens=6, ignore_eos=True).tokens
