"""A decode step computes the live rows only: its cost follows the work, not the table's capacity.

The row buckets are held to their contract (bounded in number, never more than 1.5x the live
rows), the rows a step picks to theirs, and the engine to computing one row for one request on
a large table, and to token-exact output when its live rows are scattered over the table.
"""

import math
import subprocess
import sys

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer
from slotinfer.engine.decoder import row_bucket, row_buckets, step_rows
from slotinfer.engine.engine import Engine


@given(st.integers(1, 512))
def test_row_buckets_are_few_and_close_to_the_live_rows(slots):
    buckets = row_buckets(slots)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == slots
    assert len(buckets) <= 2 * math.log2(slots) + 1  # compiled variants stay bounded by the configuration
    for n in range(1, slots + 1):
        b = row_bucket(n, slots)
        assert n <= b <= min(slots, math.ceil(1.5 * n))


@given(st.data())
def test_a_step_computes_every_live_slot_and_pads_with_idle_ones(data):
    slots = data.draw(st.integers(1, 40))
    live = sorted(data.draw(st.sets(st.integers(0, slots - 1), min_size=1)))
    rows, prefix = step_rows(live, slots)
    assert len(rows) == len(set(rows)) == row_bucket(len(live), slots)
    assert set(live) <= set(rows) and all(0 <= r < slots for r in rows)
    assert prefix == (rows == list(range(len(rows))))
    if live == list(range(len(live))):  # lowest slots busy: the step reads a slice of the table
        assert prefix


def test_one_request_on_a_large_table_computes_one_row(models):
    m = models["qwen3"]
    eng = Engine(m, slots=32, max_len=64)
    item = eng.make_item([5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    eng.add(item)
    eng.run_until_done()
    assert item.handle.result(0).tokens == m.generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True).tokens
    assert {key[0] for key in eng.decoder._compiled} == {1}  # every step ran on one row


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_scattered_live_rows_are_gathered_and_token_exact(models, family):
    """The first slots finish early: the rows still decoding sit at the end of the table, and the
    step gathers them instead of computing the idle slots in front."""
    m = models[family]
    eng = Engine(m, slots=6, max_len=64)
    prompts = [[3 + i, 40 + i, 90 + i, 7] for i in range(6)]
    budgets = [2, 2, 3, 14, 14, 14]
    items = [eng.make_item(p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, budgets)]
    for it in items:
        eng.add(it)
    eng.run_until_done()
    for it, p, n in zip(items, prompts, budgets):
        assert it.handle.result(0).tokens == m.generate(p, max_tokens=n, ignore_eos=True).tokens
    layouts = {(key[0], key[1]) for key in eng.decoder._compiled}
    assert (3, False) in layouts  # slots 3..5 alone, gathered
    assert all(n <= 6 for n, _ in layouts)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="an address-space limit is the CPU's way to run short")
def test_a_table_that_does_not_fit_is_a_typed_error_not_a_crash(model_dir):
    """Under an address-space limit (ulimit -v, as containers set), a K/V pool larger than what
    the limit leaves is refused with OutOfMemoryError; by default a table of 64 slots x 200,000
    tokens (~13 GiB of K/V reserved up front) starts within the limit, its pool sized by the memory."""
    code = f"""
import resource, slotinfer
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.RLIM_INFINITY))
m = slotinfer.load({str(model_dir("llama"))!r})
try:
    slotinfer.Inferencer(m, slots=64, max_len=200_000, kv_cache_bytes=13 << 30, start=False)
except slotinfer.OutOfMemoryError as e:
    print("refused:", e)
inf = slotinfer.Inferencer(m, slots=64, max_len=200_000)
print("served:", len(inf.generate("hi", max_tokens=3, ignore_eos=True).tokens))
print("pool under 3 GiB:", inf.engine.memory()["kv_cache_bytes"] < 3 << 30)
inf.close()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"refused: the K/V pool of kv_cache_bytes={13 << 30} (" in proc.stdout
    assert "lower kv_cache_bytes" in proc.stdout and "served: 3" in proc.stdout and "pool under 3 GiB: True" in proc.stdout


def test_float16_kv_halves_the_table_and_keeps_batch_independence(models):
    """K/V kept in float16 (the model computing in float32) take half the bytes; a request's
    greedy tokens are the same alone or beside others, as with float32 K/V."""
    m = models["qwen3"]
    prompts = [[5, 6, 7, 8, 9], [40, 41], [100, 7, 300, 12, 13, 14, 15, 16], [3]]

    def run(slots, ps, dtype):
        eng = Engine(m, slots=slots, max_len=64, kv_dtype=dtype)
        items = [eng.make_item(p, max_tokens=10, ignore_eos=True) for p in ps]
        for it in items:
            eng.add(it)
        eng.run_until_done()
        return eng, [it.handle.result(0).tokens for it in items]

    half, together = run(4, prompts, "float16")
    full, _ = run(4, prompts, None)
    assert half.table.keys[0].dtype == mx.float16 and half.memory()["kv_cache_bytes"] * 2 == full.memory()["kv_cache_bytes"]
    assert together == [run(1, [p], "float16")[1][0] for p in prompts]


def test_a_bad_kv_dtype_is_refused(models):
    with pytest.raises(slotinfer.InvalidRequestError, match="kv_dtype must be one of"):
        slotinfer.Inferencer(models["llama"], slots=1, max_len=64, kv_dtype="int8", start=False)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_q8_kv_keeps_a_row_alone_equal_to_batched_through_chunks_the_prefix_cache_and_preemption(models, family):
    """K/V in q8_0 blocks (0.27x float32's bytes): a request's greedy tokens are the same alone as
    beside others, with its prompt cut into prefill chunks across blocks, again from the prefix cache's
    blocks, and when a pool too small for all of them preempts some and they resume."""
    m = models[family]  # head_dim 32; Gemma 2: sliding windows and soft-capping too
    prompts = [[3 + (7 * i + 11 * j) % 400 for j in range(n)] for i, n in enumerate([5, 40, 130, 17, 70])]

    def run(ps, slots, **kw):
        eng = Engine(m, slots=slots, max_len=256, kv_dtype="q8_0", block_size=16, prefill_tokens=32, **kw)
        items = [eng.make_item(p, max_tokens=20, ignore_eos=True) for p in ps]
        for it in items:
            eng.add(it)
        eng.run_until_done()
        return eng, [it.handle.result(0).tokens for it in items]

    alone = [run([p], 1, prefix_cache_bytes=0)[1][0] for p in prompts]
    eng, together = run(prompts, 4, prefix_cache_bytes=0)
    assert together == alone and eng.table.keys[0].dtype == mx.uint8
    assert eng.table.block_nbytes * 128 == Engine(m, slots=1, max_len=64, block_size=16).table.block_nbytes * 34
    eng, twice = run(prompts + prompts, 4, prefix_cache_bytes=1 << 22)
    assert twice == alone + alone and eng.table.cache_stats()["hit_tokens"] > 0
    eng, tight = run(prompts, 4, prefix_cache_bytes=0, kv_cache_bytes=eng.table.block_nbytes * 14)
    assert tight == alone and eng.counters["preempted"] >= 1


def test_q8_kv_runs_on_mlx_ops_where_the_native_ones_are_off(model_dir, monkeypatch):
    """Without the native ops (SLOTINFER_NATIVE_OPS=0, as on a GPU) MLX's ops dequantize the blocks a
    step reads: a row alone is still its batched self, and the bytes are q8_0's."""
    monkeypatch.setenv("SLOTINFER_NATIVE_OPS", "0")
    m = slotinfer.load(model_dir("qwen3"))
    assert m.net.model.layers[0].self_attn.ops.paged_decode is None
    prompts = [[5, 6, 7, 8, 9] * 30, [40, 41], [100, 7, 300]]

    def run(ps, slots):
        eng = Engine(m, slots=slots, max_len=256, kv_dtype="q8_0", block_size=16, prefill_tokens=64)
        items = [eng.make_item(p, max_tokens=12, ignore_eos=True) for p in ps]
        for it in items:
            eng.add(it)
        eng.run_until_done()
        return eng, [it.handle.result(0).tokens for it in items]

    eng, together = run(prompts, 3)
    assert eng.table.keys[0].dtype == mx.uint8
    assert together == [run([p], 1)[1][0] for p in prompts]
