"""The quantized-linear kernels (slotinfer/cpu/qkernel) against the GGUF reference.

The kernel tests are skipped where the extension was not built at install time (no C++20
compiler then); the fallback is tested everywhere.  Every loop set this CPU runs (AVX-512, AVX2,
portable) is held to the same properties.
"""

import subprocess
import sys


import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer  # first: the BLAS before mlx.core
import mlx.core as mx
import mlx.utils
from slotinfer.cpu import qkernel

gguf = pytest.importorskip("gguf")
module = qkernel.load()
built = pytest.mark.skipif(module is None, reason=f"the qkernel extension is {qkernel.status()}")

FORMATS = list(qkernel.FORMATS)  # GGUF type names
K_QUANTS = ("Q4_K", "Q6_K")  # super-blocks of 256 weights; gguf has no quantizer for them


def k_of(qtype, k_blocks):
    """A row length of about ``k_blocks`` blocks that ``qtype``'s blocks divide."""
    return 256 * (1 + k_blocks % 3) if qtype in K_QUANTS else 32 * k_blocks


def blocks(qtype, n, k, seed):
    """Blocks of ``qtype`` and gguf's float reading of them: gguf's quantizer on random weights, or for the
    K-quants random blocks with every bit pattern of their scales and values (the test writer's)."""
    from gguf_fixtures import random_tensor_blocks

    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        b = random_tensor_blocks((n, k), t, float(rng.uniform(0.01, 2.0)), rng)
    else:
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, size=(n, 1))).astype(np.float32)
        b = gguf.quants.quantize(w, t)
    return b, gguf.quants.dequantize(b, t).reshape(n, k).astype(np.float64)


def qlinear(x, b, qtype):
    return np.array(qkernel.qlinear(mx.array(x), mx.array(b), qkernel.FORMATS[qtype]))


@built
@given(qtype=st.sampled_from(FORMATS), n=st.integers(1, 70), k_blocks=st.integers(1, 12),
       m=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_matches_dequantize_then_matmul(kernels, qtype, n, k_blocks, m, seed):
    """Within float32 summation error of numpy's product of the GGUF reference's dequantized weights."""
    k = k_of(qtype, k_blocks)
    b, wd = blocks(qtype, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
    out = qlinear(x, b, qtype)
    ref = x.astype(np.float64) @ wd.T
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).T  # what the sum's rounding error is relative to
    assert out.shape == (m, n) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= 1e-6 * k * scale + 1e-30)


@built
@given(qtype=st.sampled_from(FORMATS), m=st.one_of(st.integers(2, 17), st.integers(2, 80)),
       seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2, 3]), long_k=st.booleans())
def test_batch_invariant(kernels, qtype, m, seed, threads, long_k):
    """A row's result is bit-identical whatever the number of rows, their values, and the thread count
    (a few rows, which skip the decoded panel up to 12 of them with AVX-512 and 8 with AVX2, and up to 16
    in two passes, drawn as often as any count)."""
    # k: a row tile takes the whole of a short k at once and a long one (over 640) in chunks, the
    # last one shorter; m: up to more rows than a panel serves
    n = 37
    k = (768 if long_k else 512) if qtype in K_QUANTS else (736 if long_k else 320)
    b, _ = blocks(qtype, n, k, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    default = module.threads()
    module.set_threads(threads)
    try:
        together = qlinear(x, b, qtype)
        module.set_threads(1)
        alone = np.concatenate([qlinear(x[i:i + 1], b, qtype) for i in range(m)])
        others = rng.standard_normal((m, k)).astype(np.float32) * 1e3
        others[m // 2] = x[m // 2]
        beside = qlinear(others, b, qtype)[m // 2]
    finally:
        module.set_threads(default)
    assert np.array_equal(together, alone)
    assert np.array_equal(beside, alone[m // 2])


@built
@given(qtype=st.sampled_from(FORMATS), n=st.integers(1, 20), k_blocks=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_weights_are_the_references_bit_for_bit(kernels, qtype, n, k_blocks, seed):
    """Every weight the loops decode is gguf's float32 reading of the block, exactly (the K-quants' d * sc
    and dmin * m are exact in float32, so no scale is rounded on the way): the product with the identity
    gives the weights back bit for bit, through the panel (k rows) and through the few-row loops
    (each unit row alone, and a few of them together), and so does the embedding lookup's dequantize."""
    from slotinfer.cpu import qlayers

    k = k_of(qtype, k_blocks)
    b, wd = blocks(qtype, n, k, seed)
    want = wd.astype(np.float32)
    eye = np.eye(k, dtype=np.float32)
    assert np.array_equal(qlinear(eye, b, qtype).T, want)
    for i in np.random.default_rng(seed).choice(k, size=3):
        assert np.array_equal(qlinear(eye[i:i + 1], b, qtype)[0], want[:, i])
    few = np.random.default_rng(seed).choice(k, size=min(k, 1 + seed % 12), replace=False)
    assert np.array_equal(qlinear(eye[few], b, qtype).T, want[:, few])
    assert np.array_equal(np.array(qlayers.dequantize(mx.array(b), qkernel.FORMATS[qtype])), want)


@built
def test_in_a_compiled_graph_with_leading_axes():
    """The primitive runs inside mx.compile, on [batch, seq, k] activations, like the model's linears."""
    b, wd = blocks("Q4_1", 48, 64, 0)
    wb = mx.array(b)
    x = np.random.default_rng(2).standard_normal((2, 3, 64)).astype(np.float32)

    @mx.compile
    def layer(x):
        return qkernel.qlinear(x * 2.0, wb, "q4_1") + 1.0

    out = np.array(layer(mx.array(x)))
    ref = (2.0 * x.astype(np.float64)) @ wd.T + 1.0
    assert out.shape == (2, 3, 48)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


@built
def test_a_product_on_every_core_gives_the_same_bits():
    """A product that takes every core at a few rows (a step the host waits for: ``all_cores``) gives
    what the one leaving a core free gives, in one graph beside it too; the block ends the setting."""
    from slotinfer.cpu import qlayers

    layer = qlayers.BlockLinear(256, 40, "q4_1")
    layer.weight = mx.array(blocks("Q4_1", 40, 256, 5)[0])
    x = mx.array(np.random.default_rng(6).standard_normal((3, 256)).astype(np.float32))
    default = module.threads()
    module.set_threads(2)
    try:
        spared = layer(x)
        with qlayers.all_cores():
            every = layer(x)
        again = layer(x)
        mx.eval(spared, every, again)
    finally:
        module.set_threads(default)
    assert np.array_equal(np.array(every), np.array(spared)) and np.array_equal(np.array(again), np.array(spared))
    assert qlayers._spare()


@built
@pytest.mark.parametrize("compiled", [False, True])
def test_strided_inputs_give_the_contiguous_result(compiled):
    """Transposed, sliced or broadcast activations and a strided weight are read as their values
    (the primitive packs them when it runs), bit for bit what their contiguous copies give."""
    b, _ = blocks("Q8_0", 24, 96, 3)
    rng = np.random.default_rng(4)
    xt = rng.standard_normal((96, 5)).astype(np.float32)  # x = xt.T: a transposed view
    wide = np.concatenate([b, b[::-1]], axis=1)  # w = wide[:, :cols]: rows of blocks a stride apart
    row = rng.standard_normal((1, 96)).astype(np.float32)

    def views(xt, wide, row):
        w = wide[:, : b.shape[1]]
        return [qkernel.qlinear(xt.T, w, "q8_0"), qkernel.qlinear(xt.T[1:4], w[::2], "q8_0"),
                qkernel.qlinear(mx.broadcast_to(row, (3, 96)), w, "q8_0")]

    run = mx.compile(views) if compiled else views
    got = [np.array(a) for a in run(mx.array(xt), mx.array(wide), mx.array(row))]
    assert np.array_equal(got[0], qlinear(np.ascontiguousarray(xt.T), b, "Q8_0"))
    assert np.array_equal(got[1], qlinear(np.ascontiguousarray(xt.T[1:4]), np.ascontiguousarray(b[::2]), "Q8_0"))
    assert np.array_equal(got[2], qlinear(np.repeat(row, 3, axis=0), b, "Q8_0"))


@built
def test_rejects_what_it_cannot_compute():
    b, _ = blocks("Q8_0", 4, 64, 0)
    with pytest.raises(ValueError):
        qkernel.qlinear(mx.zeros((1, 64)), mx.array(b), "q5_1")
    with pytest.raises(ValueError):  # 64 is not a whole Q4_K super-block
        qkernel.qlinear(mx.zeros((1, 64)), mx.zeros((4, 36), dtype=mx.uint8), "q4_k")
    with pytest.raises(ValueError):  # k does not match the blocks
        qkernel.qlinear(mx.zeros((1, 96)), mx.array(b), "q8_0")
    with pytest.raises(ValueError):
        qkernel.qlinear(mx.zeros((1, 64), dtype=mx.float16), mx.array(b), "q8_0")


# -- the real model: SmolLM2-135M-Instruct Q4_1 (its embedding and tied head in Q8_0) ---------------

SMOL_PROMPTS = ["The capital of France is", "In 2024, there were 12345 cats and 3 dogs in the",
                "def fibonacci(n):", "The three primary colors are", "Water boils at",
                "Once upon a time, in a small village,", "The largest planet in our solar system is",
                "To make a cup of tea, first", "1, 2, 3, 4, 5,", "Photosynthesis is the process by which"]
SMOL_CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
              [{"role": "user", "content": "Name a fruit."}]]
SMOL_NEW = 32


@pytest.fixture(scope="module")
def smol_prompts(smollm2):
    return SMOL_PROMPTS + [smollm2.apply_chat_template(c) for c in SMOL_CHATS]


@built
def test_smollm2_keeps_its_blocks(smollm2):
    """On CPU the GGUF's matrices stay in their blocks: the weights take about the file's size."""
    import os

    from slotinfer import device
    from slotinfer.cpu.qlayers import BlockEmbedding, BlockLinear

    if not device.cpu_block_kernels():
        pytest.skip("the CPU policy computes in float32 here (SLOTINFER_QUANT_KERNELS=0 or a GPU)")
    layer = smollm2.net.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, BlockLinear) and layer.mlp.gate_up_proj.fmt == "q4_1"
    assert isinstance(smollm2.net.model.embed_tokens, BlockEmbedding)  # Q8_0, and the tied head
    held = sum(v.nbytes for _, v in mlx.utils.tree_flatten(smollm2.net.parameters()))
    assert held <= 1.2 * os.path.getsize(smollm2.path)


@built
def test_smollm2_greedy_tokens_agree_with_float32(smollm2, smol_prompts):
    """Greedy tokens through the kernels against the float32 path (held to transformers by
    test_parity_transformers.py): at least 11 of the 12 prompts' 32 tokens the same."""
    dense = slotinfer.load(smollm2.path, dtype="float32")
    want = [r.tokens for r in dense.batch_generate(smol_prompts, max_tokens=SMOL_NEW)]
    got = [r.tokens for r in smollm2.batch_generate(smol_prompts, max_tokens=SMOL_NEW)]
    same = sum(g == w for g, w in zip(got, want))
    assert same >= 11, f"{same} of {len(want)} prompts agree"


@built
def test_smollm2_greedy_alone_equals_batched(smollm2, smol_prompts):
    """Each prompt's tokens are the same generated alone and among the others (every other prompt
    alone, to keep the test short; the rows are independent)."""
    batched = [r.tokens for r in smollm2.batch_generate(smol_prompts, max_tokens=SMOL_NEW)]
    for prompt, tokens in list(zip(smol_prompts, batched))[::2]:
        assert smollm2.generate(prompt, max_tokens=SMOL_NEW).tokens == tokens, prompt


# -- the policy, and the fallback where the kernels are missing ------------------------------------

def test_policy_and_its_override(monkeypatch):
    from slotinfer import device

    assert device.cpu_block_kernels("gpu") is False  # MLX's own quantized kernels serve there
    assert device.cpu_block_kernels("cpu") is (module is not None)
    monkeypatch.setenv("SLOTINFER_QUANT_KERNELS", "0")
    assert device.cpu_block_kernels("cpu") is False
    assert device.describe()["quant_kernels"].startswith("off (SLOTINFER_QUANT_KERNELS=0)")


FALLBACK = """
import sys
sys.modules["slotinfer.cpu.qkernel._qkernel"] = None  # as if the install had no compiler
import slotinfer, mlx.nn as nn
from slotinfer import default_model, device
print(device.describe()["quant_kernels"])
if default_model.path() is not None:
    m = slotinfer.load(default_model.path())
    print(type(m.net.model.layers[0].mlp.gate_up_proj).__name__, m.generate("The capital of France is",
          max_tokens=4).text.strip())
"""


def test_without_the_extension_the_cpu_computes_in_float32():
    """A machine where the extension is missing loads quantized GGUFs dequantized, as before, and
    `slotinfer info` says why."""
    out = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("off, GGUF weights are dequantized to float32: unavailable: it was not built")
    if len(lines) > 1:
        assert lines[1].startswith("Linear Paris")
