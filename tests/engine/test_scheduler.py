"""A request's lifecycle has one owner: every state an item passes through is a step of
``TRANSITIONS`` (waiting -> prefilling -> decoding -> finished, cancelled or failed from any
state that has not ended), and it ends in exactly one terminal state that matches what its
handle reports."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotinfer import Inferencer
from slotinfer.engine.engine import Engine
from slotinfer.errors import EngineClosed, EngineError, QueueFull
from slotinfer.engine.item_processor import TRANSITIONS, ItemProcessor, State

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
    Inferencer queueing it, never replaces the hook, and a cancel heard before add() is not lost:
    add() hears it again."""
    engine = Engine(models["qwen3"], slots=1, max_len=32)
    early, late = engine.make_item([5, 6, 7], max_tokens=4), engine.make_item([5, 6], max_tokens=4)
    hooks = early.handle._on_cancel, late.handle._on_cancel
    assert None not in hooks
    early.handle.cancel()
    engine.items.reap_cancelled()  # heard while not yet added: passed over
    assert early.state is State.WAITING and not early.handle.done()
    engine.add(early)
    engine.add(late)
    assert late.handle._on_cancel is hooks[1]
    engine.step()
    late.handle.cancel()
    engine.run_until_done()
    assert early.state is late.state is State.CANCELLED
    assert early.handle.result(0).finish_reason == late.handle.result(0).finish_reason == "cancelled"


def paths(moves) -> dict:
    """Each item's states, in order, from the recorded moves (checked to chain)."""
    out = {}
    for rid, frm, to in moves:
        path = out.setdefault(rid, [frm])
        assert path[-1] is frm
        path.append(to)
    return out


def check_path(path, item):
    assert path[0] is State.WAITING
    assert all(b in TRANSITIONS[a] for a, b in zip(path, path[1:])), path
    assert [s for s in path if s.ended] == [path[-1]] and item.state is path[-1], path


def check_table(engine):
    """The slot table's lengths and new_batch_idx agree with the items in the slots."""
    table, by_slot = engine.table, engine.items.by_slot
    new = sorted(int(i) for i in table.new_batch_idx if i >= 0)
    assert new == list(range(len(new)))  # a FIFO of the slots still prefilling, without gaps
    for slot, it in enumerate(by_slot):
        assert (table.new_batch_idx[slot] >= 0) == (it is not None and it.state is State.PREFILLING)
        want = 0 if it is None else it.prefilled if it.state is State.PREFILLING else len(it.prompt) + it.issued - 1
        assert table.lengths[slot] == want
    assert engine.items.prefilling() == sorted(
        (it for it in by_slot if it is not None and it.state is State.PREFILLING), key=lambda it: it.t_admit)


class _Raise:
    """An on_token callback that raises at its ``n``-th token: it fails its own request."""

    def __init__(self, n):
        self.n = n

    def __call__(self, ev):
        self.n -= 1
        if self.n < 0:
            raise ValueError("a consumer's bug")


_submit = st.tuples(st.just("submit"), st.integers(1, 30), st.integers(1, 8), st.booleans(),
                    st.one_of(st.none(), st.integers(0, 4)))
_ENDS = {"cancelled": State.CANCELLED, "error": State.FAILED, "stop": State.FINISHED, "length": State.FINISHED}


def _close(engine, items, drain):
    if not drain:
        for it in items:
            it.handle.cancel()
    engine.run_until_done()


@given(ops=st.lists(st.one_of(_submit, _submit, st.tuples(st.just("cancel"), st.integers(0, 20)),
                              st.tuples(st.just("step"), st.integers(1, 4)), st.tuples(st.just("fail")),
                              st.tuples(st.just("close"), st.booleans())), max_size=25),
       prefill=st.sampled_from([4, 512]))
@settings(max_examples=8 * settings.default.max_examples)  # ~10 ms each: orders of prefills need many
def test_submit_cancel_step_fail_close_keep_items_and_slot_table_in_step(models, recorded, ops, prefill):
    """After every operation, each item is where its path says and the slot table's lengths and
    new_batch_idx match the items in the slots; at the end every path is one of the table's."""
    recorded.clear()
    engine = Engine(models["llama"], slots=3, max_len=48, prefill_tokens=prefill)
    items = []
    for op in ops:
        if op[0] == "submit":
            _, n, max_tokens, ignore_eos, raise_at = op
            it = engine.make_item([3 + (7 * i + n) % 400 for i in range(n)], max_tokens=max_tokens,
                                  ignore_eos=ignore_eos, on_token=None if raise_at is None else _Raise(raise_at))
            engine.add(it)
            items.append(it)
        elif op[0] == "cancel" and items:
            items[op[1] % len(items)].handle.cancel()
        elif op[0] == "step":
            for _ in range(op[1]):
                if engine.busy:
                    engine.step_or_fail()
        elif op[0] == "fail":
            engine.fail_all(RuntimeError("the device went away"))
        elif op[0] == "close":
            _close(engine, items, drain=op[1])
        for it in items:
            assert (it.slot >= 0 and engine.items.by_slot[it.slot] is it) == (
                it.state in (State.PREFILLING, State.DECODING))
        check_table(engine)
    _close(engine, items, drain=True)
    walked = paths(recorded)
    for it in items:
        check_path(walked[it.id], it)
        try:
            reason = it.handle.result(0).finish_reason
        except EngineError:
            reason = "error"
        assert _ENDS[reason] is it.state
    assert engine.items.finished == len(items)
    assert sorted(engine.items.free) == [0, 1, 2] and not engine.busy


@given(ops=st.lists(st.one_of(st.tuples(st.just("submit"), st.integers(1, 20), st.integers(1, 6)),
                              st.tuples(st.just("cancel"), st.integers(0, 20))), max_size=16),
       drain=st.booleans(), max_queue=st.sampled_from([0, 2]))
def test_through_the_inferencer_every_request_ends_once_in_the_item_processor(models, recorded, ops, drain,
                                                                             max_queue):
    """Requests cancelled in the Inferencer's own queue, in a slot, or never, each walk the table
    to one end through the item processor, which the Inferencer leaves holding nothing."""
    recorded.clear()
    inf = Inferencer(models["llama"], slots=2, max_len=48, max_queue=max_queue)
    handles = []
    for op in ops:
        if op[0] == "submit":
            try:
                handles.append(inf.submit([3 + (5 * i + op[1]) % 400 for i in range(op[1])], max_tokens=op[2],
                                          ignore_eos=True, block=False))
            except QueueFull:
                pass
        elif handles:
            handles[op[1] % len(handles)].cancel()
    inf.close(drain=drain)
    walked = paths(recorded)
    for h in handles:  # one cancelled may have ended before its cancellation was heard
        want = ("length",) if drain and not h.cancel_requested else ("cancelled", "length")
        assert h.result(0).finish_reason in want
        assert walked[h.id][0] is State.WAITING and walked[h.id][-1] is _ENDS[h.result(0).finish_reason]
        assert all(b in TRANSITIONS[a] for a, b in zip(walked[h.id], walked[h.id][1:]))
    assert inf.engine.items.finished == len(handles)
    assert inf.engine.in_flight() == [] and inf.engine.room() == 2


def test_a_dropped_never_started_inferencer_ends_its_requests_through_the_table(models, recorded):
    import gc

    recorded.clear()
    held = []

    def one():
        inf = Inferencer(models["qwen3"], slots=1, max_len=64, start=False)
        held.extend(inf.submit([5 + i, 6], max_tokens=2) for i in range(2))

    one()
    gc.collect()
    walked = paths(recorded)
    for h in held:
        with pytest.raises(EngineClosed, match="dropped"):
            h.result(timeout=10)
        assert walked[h.id] == [State.WAITING, State.FAILED]


@given(n=st.integers(1, 12), max_queue=st.sampled_from([0, 3, 5]))
@settings(max_examples=10, deadline=None)
def test_requests_wait_in_one_queue_and_max_queue_bounds_those_no_slot_awaits(models, n, max_queue):
    """Once the worker has turned, every request it was given waits in the engine's one FIFO, in
    submission order, and no more than ``max_queue`` wait with no free slot for them."""
    import time

    inf = Inferencer(models["llama"], slots=2, max_len=4096, max_queue=max_queue)
    running = [inf.submit([5 + i, 6], max_tokens=4000, ignore_eos=True) for i in range(2)]
    for h in running:
        next(iter(h))  # both slots are busy
    queued = []
    for i in range(n):
        try:
            queued.append(inf.submit([9 + i, 6], max_tokens=2, block=False))
        except QueueFull:
            pass
    time.sleep(0.3)  # several worker turns
    waiting = [it for it in inf.engine.in_flight() if it.state is State.WAITING]
    assert [it.handle for it in waiting] == queued
    assert len(queued) == (n if not max_queue else min(n, max_queue))
    assert inf.stats()["waiting"] == len(queued)
    inf.close(drain=False)
    assert {h.result(timeout=30).finish_reason for h in [*running, *queued]} == {"cancelled"}
