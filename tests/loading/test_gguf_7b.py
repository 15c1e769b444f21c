"""A 7B-shaped Q4_0 GGUF loads and decodes on CPU in about its file's memory.

The file has Llama 2 7B's sizes (3.5 GiB of random Q4_0 blocks, tests/gguf_fixtures.py's
``write_random_gguf``); in float32 its weights would take 25 GiB, more than a 24 GiB machine
has.  Writing, loading and decoding it takes 1-2 minutes on 2 cores, so the test runs only where
``SLOTINFER_EXAMPLES`` is set (the long runs); ``benchmarks/bench_gguf_7b.py`` reports the same
figures.
"""

import os
import sys
from pathlib import Path

import pytest

import slotinfer  # noqa: F401  (first: the BLAS before mlx.core)
from slotinfer import device

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_gguf_7b import measure, write  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not os.environ.get("SLOTINFER_EXAMPLES"), reason="slow (1-2 minutes): set SLOTINFER_EXAMPLES"),
    pytest.mark.skipif(device.default_device() != "cpu" or not device.cpu_block_kernels(),
                       reason="the CPU's own quantized kernels keep the blocks (float32 would take 25 GiB)"),
]


def test_7b_q4_0_loads_in_its_files_memory_and_decodes_alike_alone_and_batched(tmp_path):
    path = tmp_path / "llama2-7b-Q4_0-random.gguf"
    try:
        write(path)
        r = measure(path, tokens=6)
    finally:
        path.unlink(missing_ok=True)  # pytest keeps its last temporary folders: not 3.5 GiB of them
    size = r["file_bytes"]
    assert size > 3.5e9
    assert r["weights_bytes"] <= 1.2 * size
    assert r["loaded_rss"] <= 1.2 * size
    assert r["load_peak_rss"] <= 1.5 * size  # no float32 copy of anything but one tensor at a time
    assert [len(t) for t in r["alone"]] == [6, 6]
    assert r["one"] == r["alone"][:1]
    assert r["two"] == r["alone"]
