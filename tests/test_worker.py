"""The embedded worker's edges: bounded queues, closing, asyncio cancellation, serve_queue's
contract, and bad parameters that must fail their own request only -- never another's."""

import pytest

import slotinfer
import slotinfer.testing


@pytest.mark.parametrize("family", slotinfer.testing.FAMILIES)
def test_a_model_used_first_by_the_worker_thread(model_dir, family):
    """Nothing a freshly loaded model holds may still be lazy on the loading thread's stream:
    the Inferencer's first step runs on its worker thread, where that stream does not exist."""
    m = slotinfer.load(model_dir(family))
    with slotinfer.Inferencer(m, slots=2, max_len=64) as inf:
        got = inf.submit("hello there", max_tokens=6, ignore_eos=True).result(timeout=60)
    assert got.tokens == m.generate("hello there", max_tokens=6, ignore_eos=True).tokens
