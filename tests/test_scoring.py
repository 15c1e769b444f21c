"""Prompt log-probs (Model.score, the echo of /v1/completions) and embeddings (Model.embed) as prefill
jobs: against the one-prompt reference forward, whatever else shares their batches, and run on the
Inferencer's worker beside streams."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotinfer
from slotinfer import device
from slotinfer.kv.views import SequenceCache
from slotinfer.embed import pooling_of
from slotinfer.engine.sampling import logsumexp, logsumexp_compiled
from slotinfer.errors import InvalidRequestError
from slotinfer.testing.embedding import make_tiny_embedding_model

REF_ATOL = 2e-4  # against the unpadded one-prompt forward (another kernel shape: float rounding)
BATCH_ATOL = 1e-5  # the same prompt scored alone and in any batch
FAMILIES = ("qwen3", "llama", "gemma3_text")

ids_st = st.lists(st.integers(3, 250), min_size=1, max_size=40)


@pytest.fixture(scope="module")
def emb(tmp_path_factory):
    return slotinfer.load(make_tiny_embedding_model(tmp_path_factory.mktemp("emb") / "qwen3-emb"))


def ref_hidden(model, ids) -> np.ndarray:
    h = model.net(mx.array([list(ids)]), SequenceCache(model.config.num_layers))
    return np.array(h[0].astype(mx.float32))


def ref_logprobs(model, ids) -> np.ndarray:
    """log-softmax over the vocabulary at every position of one unpadded forward of ``ids`` alone (float64)."""
    h = model.net(mx.array([list(ids)]), SequenceCache(model.config.num_layers))
    z = np.array(model.net.head(h[0]).astype(mx.float32)).astype(np.float64)
    return z - np.logaddexp.reduce(z, axis=-1, keepdims=True)


# -- prompt log-probs -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_are_the_reference_forwards(models, family):
    model = models[family]
    prompts = [[5, 9, 40, 41, 100, 7], [200], [17, 18, 19] * 9, "Hello there, world"]
    for s, p in zip(model.score(prompts, top_logprobs=3), prompts):
        ids = model.encode_prompt(p)
        lp = ref_logprobs(model, ids)
        assert s.tokens == ids and s.logprobs[0] is None and s.top_logprobs[0] is None
        want = [lp[j - 1, ids[j]] for j in range(1, len(ids))]
        np.testing.assert_allclose(s.logprobs[1:], want, atol=REF_ATOL)
        for j in range(1, len(ids)):
            top = s.top_logprobs[j]
            best = np.argsort(-lp[j - 1])[:3]
            assert [t for t, _ in top][0] == best[0]
            np.testing.assert_allclose([v for _, v in top], lp[j - 1, best], atol=REF_ATOL)
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


@settings(deadline=None)
@given(prompts=st.lists(ids_st, min_size=1, max_size=6), budget=st.integers(1, 200), k=st.integers(0, 4),
       where=st.integers(0, 5))
def test_prompt_logprobs_do_not_depend_on_the_batch(models, prompts, budget, k, where):
    """A prompt's log-probs are the same alone and among any others, in any budget (batch-invariant)."""
    model = models["qwen3"]
    probe = [11, 12, 13, 14, 15, 16, 17]
    batch = prompts[:where] + [probe] + prompts[where:]
    alone = model.score([probe], top_logprobs=k)[0]
    got = model.score(batch, top_logprobs=k, token_budget=budget)[min(where, len(prompts))]
    assert got.tokens == probe
    np.testing.assert_allclose(got.logprobs[1:], alone.logprobs[1:], atol=BATCH_ATOL, rtol=0)
    if k:
        assert [[t for t, _ in x] for x in got.top_logprobs[1:]] == [[t for t, _ in x] for x in alone.top_logprobs[1:]]


@pytest.mark.parametrize("budget", [None, 7, 16])
def test_a_quantized_models_prompt_scores_bit_for_bit_alone_and_padded(smollm2, budget):
    """Where every op is row-local (the real Q4_1 model on the CPU kernels), a short prompt padded beside
    longer ones scores bit for bit as alone: its prefill attention's sums do not depend on the padded
    width (a matrix product's blocking would)."""
    if device.model_ops().prefill_attention is None or not device.cpu_block_kernels():
        pytest.skip("float products and attention by matrix products: within float rounding, BATCH_ATOL")
    probe = "The capital of France is"
    others = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11", "Hi", "def fibonacci(n):\n    return"]
    alone = smollm2.score([probe], top_logprobs=2)[0]
    for where in range(len(others) + 1):
        got = smollm2.score(others[:where] + [probe] + others[where:], top_logprobs=2, token_budget=budget)[where]
        assert got.logprobs[1:] == alone.logprobs[1:] and got.top_logprobs[1:] == alone.top_logprobs[1:]


def test_a_bad_prompt_fails_alone_and_bad_requests_raise(models):
    model = models["qwen3"]
    out = model.score([[5, 6], [], [10 ** 9], "ok text"])
    assert out[0].error is None and out[3].error is None
    assert isinstance(out[1].error, InvalidRequestError) and isinstance(out[2].error, InvalidRequestError)
    for bad in (dict(prompts="one prompt"), dict(prompts=[[1, 2]], top_logprobs=21),
                dict(prompts=[[1, 2]], token_budget=0), dict(prompts=[[1, 2]], top_logprobs=True)):
        with pytest.raises(InvalidRequestError):
            model.score(**bad)


@settings(max_examples=10)
@given(width=st.sampled_from([49152, 32000, 1000, 130, 3]), rows=st.integers(1, 5), seed=st.integers(0, 2**16),
       masked=st.floats(0, 0.9))
def test_logsumexp_is_float64s_and_row_by_row(width, rows, seed, masked):
    """The log-softmax normalizer of scores and logprobs: within 1e-5 of float64 over a whole vocabulary
    (MLX's own sum drifts by 2e-4 at 49,152 logits), -inf logits allowed, each row alone bit-identical."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, width)) * 3 + 5
    z[rng.random((rows, width)) < masked] = -np.inf
    z[:, 0] = 9.0
    z = z.astype(np.float32)
    got = np.array(logsumexp(mx.array(z)))
    want = np.logaddexp.reduce(z.astype(np.float64), axis=-1)
    assert np.abs(got - want).max() <= 1e-5
    fused = np.array(logsumexp_compiled(mx.array(z)))
    assert fused.shape == (rows, 1) and np.abs(fused[:, 0] - want).max() <= 1e-5
    for r in range(rows):
        assert np.array(logsumexp(mx.array(z[r:r + 1])))[0] == got[r]
        assert np.array(logsumexp_compiled(mx.array(z[r:r + 1])))[0, 0] == fused[r, 0]
    assert np.array(logsumexp(mx.full((1, width), -np.inf)))[0] == -np.inf


# -- embeddings -----------------------------------------------------------------------------------

def test_embedding_pooling_is_read_from_the_folder(emb, models, tmp_path):
    assert pooling_of(emb) == "last"
    assert pooling_of(models["qwen3"]) == "last"  # a folder without sentence-transformers' files
    mean = slotinfer.load(make_tiny_embedding_model(tmp_path / "mean", pooling="mean"))
    assert pooling_of(mean) == "mean"
    np.testing.assert_allclose(mean.embed(["a cat sat"]), mean.embed(["a cat sat"], pooling="mean"))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_the_pooled_reference_hidden_states(emb, pooling):
    texts = ["a cat sat on the mat", "dogs", [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    v = emb.embed(texts, pooling=pooling)
    assert v.shape == (3, emb.config.hidden_size) and v.dtype == np.float32
    for row, t in zip(v, texts):
        h = ref_hidden(emb, emb.encode_prompt(t))
        want = h[-1] if pooling == "last" else h.mean(axis=0)
        np.testing.assert_allclose(row, want / np.linalg.norm(want), atol=1e-5)
    raw = emb.embed(texts, pooling=pooling, normalize=False)
    cut = emb.embed(texts, pooling=pooling, dimensions=16)
    np.testing.assert_allclose(cut, raw[:, :16] / np.linalg.norm(raw[:, :16], axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)


@settings(deadline=None)
@given(texts=st.lists(ids_st, min_size=1, max_size=6), budget=st.integers(1, 200), pooling=st.sampled_from(["last", "mean"]))
def test_embeddings_do_not_depend_on_the_batch(emb, texts, budget, pooling):
    together = emb.embed(texts, pooling=pooling, token_budget=budget)
    for row, t in zip(together, texts):
        np.testing.assert_allclose(row, emb.embed([t], pooling=pooling)[0], atol=BATCH_ATOL, rtol=0)


def test_bad_embedding_requests_raise_naming_the_problem(emb):
    for kw, words in [(dict(texts="one"), "wrap it in a list"), (dict(texts=["a"], pooling="max"), "pooling"),
                      (dict(texts=["a"], dimensions=0), "dimensions"), (dict(texts=["a"], dimensions=10 ** 6), "dimensions"),
                      (dict(texts=["a", ""]), "texts[1]"), (dict(texts=[[10 ** 9]]), "texts[0]")]:
        with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[")):
            emb.embed(**kw)
    assert emb.embed([]).shape == (0, emb.config.hidden_size)


# -- on the Inferencer's worker, beside streams ------------------------------------------------------

def test_the_workers_jobs_are_the_models_beside_running_streams(emb):
    texts = [[int(t) for t in np.random.default_rng(i).integers(3, 250, size=5 + 7 * i)] for i in range(8)]
    want_streams = [emb.generate(t, max_tokens=12, ignore_eos=True).tokens for t in texts[:3]]
    with slotinfer.Inferencer(emb, slots=4, max_len=128, prefill_tokens=32) as inf:
        streams = [inf.submit(t, max_tokens=12, ignore_eos=True) for t in texts[:3]]
        vecs = inf.submit_embed(texts, pooling="last")
        scores = inf.submit_score(texts, top_logprobs=2)
        got = inf.embed(texts[:2], dimensions=8)
        assert [s.result().tokens for s in streams] == want_streams
        np.testing.assert_allclose(np.stack([r.vector for r in vecs.result()]),
                                   emb.embed(texts, pooling="last", token_budget=32), atol=1e-6)
        for a, b in zip(scores.result(), emb.score(texts, top_logprobs=2, token_budget=32)):
            np.testing.assert_allclose(a.logprobs[1:], b.logprobs[1:], atol=1e-6)
        np.testing.assert_allclose(got, emb.embed(texts[:2], dimensions=8), atol=BATCH_ATOL)
        with pytest.raises(InvalidRequestError):
            inf.submit_embed(["x"], pooling="cls")


@pytest.mark.parametrize("kind", ["embed", "score"])
def test_a_stream_waits_at_most_one_batch_per_token(emb, kind):
    """Between two tokens of a running stream the worker finishes at most one batch of an embedding or
    scoring job (one unit each), and the job advances while the stream runs."""
    texts = [[40, 41, 42, 43]] * 120  # equal lengths: batches of budget // length prompts
    log = []
    with slotinfer.Inferencer(emb, slots=2, max_len=128, prefill_tokens=16) as inf:
        h = inf.submit([5, 6], max_tokens=40, ignore_eos=True, on_token=lambda ev: log.append("t"))
        submit = inf.submit_embed if kind == "embed" else inf.submit_score
        job = submit(texts, on_result=lambda i, r: log.append("j"))
        h.result()
        assert all(r.error is None for r in job.result())
    per_batch = 16 // len(texts[0])
    tokens = [i for i, x in enumerate(log) if x == "t"]
    between = [log[a:b].count("j") for a, b in zip(tokens, tokens[1:])]
    assert max(between) <= per_batch, between
    assert sum(between) >= 10 * per_batch, between  # interleaved, not run before or after the stream
