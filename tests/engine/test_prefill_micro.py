"""Long prompts through the engine's prefill, whatever its budget and the forwards it is cut into
(``Encoder.micro``, :func:`~slotinfer.engine.encoder.micro_calls`): each row's greedy tokens are
those of the prompt alone, with key spans long enough for the tiled attention."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotinfer.engine.encoder import Chunk, micro_calls
from slotinfer.engine.engine import Engine


@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), starts=st.lists(st.integers(0, 9), min_size=6),
       cap=st.integers(0, 64))
def test_micro_calls_cover_each_chunk_in_order(lens, starts, cap):
    chunks = [Chunk(i, s, list(range(s, s + n)), i % 2 == 0) for i, (n, s) in enumerate(zip(lens, starts))]
    calls = micro_calls(chunks, cap)
    seen = {i: [] for i in range(len(chunks))}
    for call in calls:
        width = max(len(p.tokens) for _, p in call)
        assert len(call) == 1 or cap == 0 or width * len(call) <= cap
        for i, p in call:
            assert p.slot == chunks[i].slot and p.start == chunks[i].start + len(seen[i])
            seen[i] += p.tokens
            assert p.last == (chunks[i].last and len(seen[i]) == len(chunks[i].tokens))
    assert all(seen[i] == c.tokens for i, c in enumerate(chunks))


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
@given(prompts=st.lists(st.lists(st.integers(3, 500), min_size=1, max_size=300), min_size=1, max_size=4),
       slots=st.integers(1, 4), budget=st.sampled_from([32, 128, 2048]), micro=st.sampled_from([0, 7, 64, 512]))
def test_long_prompts_in_any_pieces_are_token_exact(models, family, prompts, slots, budget, micro):
    m = models[family]
    engine = Engine(m, slots=slots, max_len=320, prefill_tokens=budget, prefix_cache_bytes=0)
    engine.encoder.micro = micro
    items = [engine.make_item(p, max_tokens=3, ignore_eos=True) for p in prompts]
    for it in items:
        engine.add(it)
    while engine.busy:
        engine.step()
    for p, it in zip(prompts, items):
        assert it.handle.result(0).tokens == m.generate(p, max_tokens=3, ignore_eos=True).tokens
