"""A request's lifecycle has one owner: every state an item passes through is a step of
``TRANSITIONS`` (waiting -> prefilling -> decoding -> finished, cancelled or failed from any
state that has not ended), and it ends in exactly one terminal state that matches what its
handle reports."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotinfer.engine import Engine
from slotinfer.errors import EngineError
from slotinfer.item_processor import TRANSITIONS, ItemProcessor, State

STEPS = 60


@pytest.fixture
def recorded(monkeypatch):
    """Every move the engine makes, as (item id, from, to), through the real ItemProcessor.move."""
    moves = []
    real = ItemProcessor.move

    def move(self, item, to):
        moves.append((item.id, item.state, to))
        return real(self, item, to)

    monkeypatch.setattr(ItemProcessor, "move", move)
    return moves


@given(reqs=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(1, 8),
                               st.one_of(st.none(), st.integers(0, 10))), min_size=1, max_size=8),
       slots=st.integers(1, 4), prefill=st.sampled_from([4, 512]))
def test_every_item_walks_the_transition_table_to_one_end(models, recorded, reqs, slots, prefill):
    """reqs: (arrival step, prompt length, max_tokens, the step its cancel comes at or None)."""
    recorded.clear()
    engine = Engine(models["qwen3"], slots=slots, max_len=64, prefill_tokens=prefill)
    items = [None] * len(reqs)
    for step in range(STEPS):
        for i, (arrival, length, max_tokens, cancel_at) in enumerate(reqs):
            if arrival == step:
                items[i] = engine.make_item(list(range(5, 5 + length)), max_tokens=max_tokens, ignore_eos=True)
                engine.add(items[i])
            if cancel_at == step and items[i] is not None:
                items[i].handle.cancel()
        if engine.busy:
            engine.step()
        elif all(it is not None for it in items):
            break
    assert not engine.busy
    for it in items:
        path = [(frm, to) for rid, frm, to in recorded if rid == it.id]
        assert path and path[0][0] is State.WAITING
        assert all(to in TRANSITIONS[frm] for frm, to in path)
        assert all(a[1] is b[0] for a, b in zip(path, path[1:]))  # each move starts where the last ended
        ends = [to for _, to in path if to.ended]
        assert len(ends) == 1 and ends[0] is it.state is path[-1][1]
        reason = it.handle.result(0).finish_reason
        assert {State.FINISHED: reason in ("stop", "length"), State.CANCELLED: reason == "cancelled"}[it.state]


def test_a_move_outside_the_table_is_refused(models):
    engine = Engine(models["qwen3"], slots=1, max_len=32)
    item = engine.make_item([5, 6, 7], max_tokens=2)
    engine.add(item)
    engine.run_until_done()
    assert item.state is State.FINISHED
    with pytest.raises(EngineError, match="cannot go from finished to decoding"):
        engine.items.move(item, State.DECODING)
    fresh = engine.make_item([5, 6], max_tokens=2)
    with pytest.raises(EngineError, match="cannot go from waiting to decoding"):
        engine.items.move(fresh, State.DECODING)


def test_a_handle_hears_its_cancel_through_one_path_from_the_moment_it_is_made(models):
    """The item processor hooks a request's cancel() as the engine makes it, once: adding it, or the
    Inferencer queueing it, never replaces the hook, and a cancel before add() is reported to
    whoever still queues the item rather than lost."""
    engine = Engine(models["qwen3"], slots=1, max_len=32)
    early, late = engine.make_item([5, 6, 7], max_tokens=4), engine.make_item([5, 6], max_tokens=4)
    hooks = early.handle._on_cancel, late.handle._on_cancel
    assert None not in hooks
    early.handle.cancel()
    assert engine.cancelled_before_add() == [early] and engine.cancelled_before_add() == []
    engine.add(early)
    engine.add(late)
    assert late.handle._on_cancel is hooks[1]
    engine.step()
    late.handle.cancel()
    engine.run_until_done()
    assert early.state is late.state is State.CANCELLED
    assert early.handle.result(0).finish_reason == late.handle.result(0).finish_reason == "cancelled"
