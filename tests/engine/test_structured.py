"""Structured output and logit adjustments inside the fused step (slotinfer.engine.structured).

What must hold: a constrained request's output follows its constraint; its greedy tokens are
the same alone (``Model.generate``) and in any batch; free rows sharing its steps keep their
tokens; a bad constraint is refused at submit, never run unconstrained.
"""

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer
from slotinfer import GrammarError, InvalidRequestError
from slotinfer.engine.engine import Engine
from slotinfer.testing import FAMILIES

from test_properties import feed

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
         "required": ["ok", "level"], "additionalProperties": False}
LIST = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4}
CONSTRAINTS = [
    {"json_schema": PERSON}, {"json_schema": FLAGS}, {"json_schema": LIST},
    {"regex": r"[0-9]{3}-[0-9]{4}"}, {"choice": ["yes", "no", "maybe not"]},
    {"grammar": 'start: "(" item (", " item)* ")"\nitem: "a" | "b" | "c"'},
]


def follows(constraint: dict, text: str) -> bool:
    """Whether ``text`` is a complete output of ``constraint``, checked without llguidance."""
    (kind, value), = constraint.items()
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    if kind == "grammar":
        return re.fullmatch(r"\([abc](, [abc])*\)", text) is not None
    doc = json.loads(text)
    if value is LIST:
        return isinstance(doc, list) and 1 <= len(doc) <= 4 and all(type(x) is int and 0 <= x <= 99 for x in doc)
    if value is PERSON:
        return (set(doc) == {"name", "age"} and isinstance(doc["name"], str) and len(doc["name"]) <= 12
                and type(doc["age"]) is int and 0 <= doc["age"] <= 120)
    return set(doc) == {"ok", "level"} and isinstance(doc["ok"], bool) and doc["level"] in ("low", "high")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_finished_output_follows_its_constraint(models, family):
    m = models[family]
    prompts = [[5, 6, 7], [40, 41], [300, 2, 9, 9]]
    jobs = [(p, c) for p in prompts for c in CONSTRAINTS]
    engine = Engine(m, slots=8, max_len=128)
    handles = feed(engine, [(i % 3, p, dict(max_tokens=60, **c)) for i, (p, c) in enumerate(jobs)])
    stopped = 0
    for (p, c), h in zip(jobs, handles):
        out = h.result(0)
        if out.finish_reason == "stop" and out.tokens[-1] not in m.eos_ids:
            assert follows(c, out.text), (c, out.text)
            stopped += 1
        elif out.finish_reason == "stop":  # an end token is allowed only where the output is complete
            assert follows(c, out.text), (c, out.text)
            stopped += 1
    assert stopped >= len(jobs) // 2  # bounded constraints mostly end within 60 tokens on random weights


constrained = st.sampled_from(CONSTRAINTS)


@st.composite
def mixed_requests(draw):
    out = []
    for _ in range(draw(st.integers(2, 6))):
        ids = draw(st.lists(st.integers(3, 500), min_size=1, max_size=30))
        params = dict(max_tokens=draw(st.integers(1, 24)))
        if draw(st.booleans()):
            params.update(draw(constrained))
        if draw(st.integers(0, 3)) == 0:
            params.update(presence_penalty=draw(st.sampled_from([0.5, -1.0])),
                          frequency_penalty=draw(st.sampled_from([0.0, 1.5])),
                          logit_bias=draw(st.dictionaries(st.integers(0, 575), st.sampled_from([-100.0, 3.0, 100.0]),
                                                          max_size=3)))
        if draw(st.booleans()):
            params.update(temperature=0.8, seed=draw(st.integers(0, 2**32 - 1)))
        out.append((draw(st.integers(0, 6)), ids, params))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@given(reqs=mixed_requests(), slots=st.sampled_from([1, 3, 8]), prefill=st.sampled_from([4, 512]))
def test_each_request_is_the_same_alone_and_in_any_batch(models, family, reqs, slots, prefill):
    """Constrained, adjusted and free requests, greedy or seeded, sharing steps in any schedule:
    each gives the tokens of ``Model.generate`` of it alone."""
    m = models[family]
    engine = Engine(m, slots=slots, max_len=64, prefill_tokens=prefill)
    for (_, ids, params), h in zip(reqs, feed(engine, reqs)):
        got, want = h.result(0), m.generate(ids, **params)
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
    assert engine.items.free == list(range(slots))


def test_free_rows_keep_their_tokens_beside_constrained_rows(models):
    m = models["qwen2"]
    free = [([5 + i, 9, 11 * i + 3], dict(max_tokens=20, ignore_eos=True)) for i in range(4)]
    alone = m.batch_generate([p for p, _ in free], max_tokens=20, ignore_eos=True, slots=4)
    engine = Engine(m, slots=8, max_len=64)
    reqs = [(0, p, kw) for p, kw in free] + [(0, [7, 7], dict(max_tokens=20, **c)) for c in CONSTRAINTS[:4]]
    handles = feed(engine, reqs)
    assert [h.result(0).tokens for h in handles[:4]] == [r.tokens for r in alone]
    assert engine.decoder.variants >= 1


def test_a_constraint_that_cannot_end_in_time_finishes_with_length(models):
    m = models["llama"]
    out = m.batch_generate([[5, 6]], regex="a{40}", max_tokens=5, slots=2)[0]
    assert out.finish_reason == "length" and len(out.tokens) == 5
    assert out.text and set(out.text) == {"a"}
    assert m.generate([5, 6], regex="a{40}", max_tokens=5).text == out.text


COMPILED = [  # read fine, refused by the compiler
    (dict(json_schema={"type": "bogus"}), "json_schema"),
    (dict(json_schema={"$ref": "#/definitions/missing"}), "json_schema"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
]


@pytest.mark.parametrize("params, param", COMPILED + [
    (dict(json_schema="{not json"), "json_schema"),
    (dict(json_schema=[1, 2]), "json_schema"),
    (dict(grammar=""), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(choice=["ok", 3]), "choice"),
    (dict(regex="a", choice=["a"]), "choice"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
])
def test_bad_constraints_and_adjustments_are_refused_at_submit(models, params, param):
    m = models["qwen3"]
    with slotinfer.Inferencer(m, slots=1, max_len=64) as inf:
        with pytest.raises(InvalidRequestError) as e:
            inf.submit([5, 6], max_tokens=4, **params)
        assert e.value.param == param
        with pytest.raises(InvalidRequestError):
            m.generate([5, 6], max_tokens=4, **params)
        assert inf.generate([5, 6], max_tokens=3).finish_reason == "length"  # the engine goes on serving
    assert (e.type is GrammarError) == ((params, param) in COMPILED)


def test_a_grammar_slower_than_the_bound_is_refused(models, monkeypatch):
    m = models["gemma2"]
    monkeypatch.setenv("SLOTINFER_GRAMMAR_SECONDS", "0.000001")
    slow = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": "[a-z]{2,9}x?"}
                                             for i in range(300)}}
    with pytest.raises(GrammarError, match="SLOTINFER_GRAMMAR_SECONDS") as e:
        m.generate([5], json_schema=slow, max_tokens=2)
    assert e.value.param == "json_schema"
    monkeypatch.setenv("SLOTINFER_GRAMMAR_SECONDS", "nope")
    with pytest.raises(ValueError, match="SLOTINFER_GRAMMAR_SECONDS"):
        m.generate([5], regex="[0-9]+x", max_tokens=2)


def test_the_noise_of_a_draw_is_finite_for_every_bit_pattern():
    """A masked token is -inf; infinite noise would make it NaN, which argmax picks."""
    import mlx.core as mx
    import numpy as np

    from slotinfer.engine.sampling import gumbel_of

    bits = mx.array([0, 1, 255, 511, 2**31, 2**32 - 512, 2**32 - 257, 2**32 - 1], dtype=mx.uint32)
    noise = np.array(gumbel_of(bits))
    assert np.isfinite(noise).all() and (np.diff(noise) >= 0).all()


def test_logit_bias_bans_and_forces_tokens(models):
    m = models["llama"]
    free = m.generate([5, 6, 7], max_tokens=8, ignore_eos=True)
    banned = free.tokens[0]
    out = m.batch_generate([[5, 6, 7]], max_tokens=8, ignore_eos=True, logit_bias={banned: -100})[0]
    assert banned not in out.tokens and out.tokens[0] != free.tokens[0]
    forced = m.batch_generate([[5, 6, 7]], max_tokens=6, ignore_eos=True, logit_bias={str(banned + 1): 100})[0]
    assert forced.tokens == [banned + 1] * 6


def test_frequency_penalty_discourages_repeats(models):
    m = models["gemma2"]
    plain = m.generate([5, 6, 7], max_tokens=24, ignore_eos=True)
    assert len(set(plain.tokens)) < 24  # random weights repeat themselves
    out = m.batch_generate([[5, 6, 7]], max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                           presence_penalty=2.0)[0]
    assert len(set(out.tokens)) > len(set(plain.tokens))


def test_streamed_constrained_output_through_the_inferencer(models):
    m = models["qwen2"]
    with slotinfer.Inferencer(m, slots=4, max_len=128) as inf:
        handles = [inf.submit([9, 8, 7 + i], max_tokens=60, json_schema=PERSON) for i in range(3)]
        free = inf.submit([9, 8, 7], max_tokens=10)
        for h in handles:
            text = "".join(ev.text for ev in h)
            out = h.result()
            assert text == out.text
            if out.finish_reason == "stop":
                assert follows({"json_schema": PERSON}, out.text)
        assert free.result().tokens == m.generate([9, 8, 7], max_tokens=10).tokens


def test_the_real_model_answers_in_the_schema(smollm2):
    m = smollm2
    prompts = [m.chat_prompt(messages=[{"role": "user", "content": q}]) for q in
               ["Describe a person as JSON.", "Who wrote Hamlet? Answer as JSON.", "Invent a character."]]
    for schema in (PERSON, FLAGS):
        for r in m.batch_generate(prompts, json_schema=schema, max_tokens=48, slots=4):
            assert r.finish_reason == "stop" and follows({"json_schema": schema}, r.text), r.text
    r = m.generate(prompts[1], choice=["Shakespeare", "Dickens", "Austen"], max_tokens=8)
    assert r.text in ("Shakespeare", "Dickens", "Austen")
