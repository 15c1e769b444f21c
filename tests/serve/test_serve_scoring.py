"""Scoring with echo, /v1/embeddings, /tokenize and /detokenize through the real server (uvicorn on
127.0.0.1) and the official ``openai`` client, against the library's own answers."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

import slotinfer
from slotinfer.serve import build_app
from slotinfer.serve.background import serving
from slotinfer.serve.schemas import ClassifyLimits
from slotinfer.testing.embedding import make_tiny_embedding_model

NAME = "tiny-emb"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return slotinfer.load(make_tiny_embedding_model(tmp_path_factory.mktemp("serve-emb") / "qwen3-emb"))


@pytest.fixture(scope="module")
def server(model):
    limits = ClassifyLimits(inputs=8, tokens=400)
    with slotinfer.Inferencer(model, slots=4, max_len=256, max_queue=16) as inf:
        with serving(build_app(inf, served_model_name=NAME, classify_limits=limits, max_body_bytes=1 << 20)) as url:
            yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path, body):
    return httpx.post(server + path, json=body, timeout=60)


# -- echo -------------------------------------------------------------------------------------------

def test_echo_with_max_tokens_0_is_the_prompts_logprobs(client, model):
    prompts = ["The cat sat on the mat", [40, 41, 42, 43, 44]]
    r = client.completions.create(model=NAME, prompt=prompts, echo=True, logprobs=2, max_tokens=0)
    assert r.usage.completion_tokens == 0
    for choice, p, s in zip(r.choices, prompts, model.score(prompts, top_logprobs=2)):
        lp = choice.logprobs
        assert choice.text == (p if isinstance(p, str) else model.tokenizer.decode(p))
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], s.logprobs[1:], atol=1e-6)
        assert len(lp.tokens) == len(lp.text_offset) == len(s.tokens)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        for top, want in zip(lp.top_logprobs[1:], s.top_logprobs[1:]):
            assert max(top.values()) == pytest.approx(want[0][1], abs=1e-6)
    assert r.usage.prompt_tokens == sum(len(s.tokens) for s in model.score(prompts))


def test_echo_then_the_completion_as_lm_eval_asks(client, model):
    """lm-eval's local-completions body: ids, echo, logprobs 1, max_tokens 1, temperature 0."""
    ids = model.encode_prompt("Question: what colour is the sky? Answer: blue")
    r = client.completions.create(model=NAME, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0,
                                  seed=1234)
    [choice] = r.choices
    want = model.generate(ids, max_tokens=1)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1  # lm-eval reads [ctxlen:-1]
    assert choice.text == model.tokenizer.decode(ids) + want.text
    np.testing.assert_allclose(lp.token_logprobs[1:-1], model.score([ids])[0].logprobs[1:], atol=1e-6)
    assert lp.text_offset[-1] == len(model.tokenizer.decode(ids))
    assert r.usage.completion_tokens == 1


def test_echo_without_logprobs_and_with_n(client, model):
    r = client.completions.create(model=NAME, prompt="Once upon", echo=True, max_tokens=4, n=2, temperature=0)
    want = model.generate("Once upon", max_tokens=4)
    assert [c.text for c in r.choices] == ["Once upon" + want.text] * 2
    assert all(c.logprobs is None for c in r.choices)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_a_streamed_echo_starts_with_the_prompt(client, model, max_tokens):
    ids = [40, 41, 42, 43, 44]
    chunks = list(client.completions.create(model=NAME, prompt=[ids], echo=True, logprobs=1, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = model.tokenizer.decode(ids) + (model.generate(ids, max_tokens=max_tokens).text if max_tokens else "")
    assert text == want
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    np.testing.assert_allclose(first.token_logprobs[1:], model.score([ids])[0].logprobs[1:], atol=1e-6)
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == max_tokens


def test_echo_refusals_name_their_field(server):
    for body, param in [({"prompt": "x", "echo": "yes"}, "echo"), ({"prompt": "x", "echo": True, "stream": "y"}, "stream"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "echo": True, "logprobs": 99}, "logprobs"),
                        ({"prompt": [[10 ** 7]], "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt")]:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


# -- embeddings -------------------------------------------------------------------------------------

def test_embeddings_are_model_embed(client, model):
    texts = ["a cat sat", "the dog ran far away"]
    r = client.embeddings.create(model=NAME, input=texts, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in r.data], model.embed(texts), atol=1e-6)
    assert [d.index for d in r.data] == [0, 1]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(model.encode_prompt(t)) for t in texts)
    ids = r.model_dump()
    assert ids["object"] == "list" and ids["model"] == NAME and ids["data"][0]["object"] == "embedding"


def test_embedding_input_forms_base64_and_dimensions(server, client, model):
    one = client.embeddings.create(model=NAME, input="a cat sat")  # the client asks for base64 and decodes it
    np.testing.assert_allclose(one.data[0].embedding, model.embed(["a cat sat"])[0], atol=1e-6)
    body = post(server, "/v1/embeddings", {"input": [[40, 41, 42], [7, 8]], "encoding_format": "base64",
                                           "dimensions": 16, "pooling": "mean"}).json()
    got = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
    np.testing.assert_allclose(got, model.embed([[40, 41, 42], [7, 8]], dimensions=16, pooling="mean"), atol=1e-6)
    flat = post(server, "/v1/embeddings", {"input": [40, 41, 42]}).json()
    np.testing.assert_allclose(flat["data"][0]["embedding"], model.embed([[40, 41, 42]])[0], atol=1e-6)


BAD_EMBEDDINGS = [
    ({}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
    ({"input": 5}, "input"), ({"input": [1.5]}, "input"), ({"input": ["a", None]}, "input"),
    ({"input": [[10 ** 7]]}, "input"), ({"input": ["x"] * 9}, "input"), ({"input": ["word " * 500]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 10 ** 6}, "dimensions"), ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "pooling": "cls"}, "pooling"), ({"input": "x", "normalize": 1}, "normalize"),
    ({"input": "x", "model": 3}, "model"), ({"input": "x", "inptu": 1}, "inptu"),
]


@pytest.mark.parametrize("body,param", BAD_EMBEDDINGS)
def test_bad_embedding_requests_are_400_naming_the_field(server, body, param):
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_unknown_models_oversize_bodies_and_the_server_serves_on(server, client):
    for path, body in [("/v1/embeddings", {"input": "x", "model": "nope"}), ("/tokenize", {"content": "x", "model": "nope"}),
                       ("/detokenize", {"tokens": [1], "model": "nope"})]:
        r = post(server, path, body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in [("/v1/embeddings", {"input": "x" * (2 << 20)}), ("/tokenize", {"content": "x" * (2 << 20)}),
                       ("/detokenize", {"tokens": [1] * (1 << 19)}),
                       ("/v1/completions", {"prompt": "x" * (2 << 20), "echo": True, "max_tokens": 0})]:
        big = post(server, path, body)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    long = post(server, "/v1/completions", {"prompt": [[7] * 3000], "echo": True, "logprobs": 1, "max_tokens": 0})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
        r = httpx.post(server + path, content=b"[1, 2", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=NAME, input=[""])
    assert len(client.embeddings.create(model=NAME, input="still serving").data) == 1


# -- tokenize / detokenize ---------------------------------------------------------------------------

def test_tokenize_in_llama_cpps_shape(server, model):
    text = "Hello world, again"
    plain = model.tokenizer.encode(text, add_special_tokens=False)
    r = post(server, "/tokenize", {"content": text}).json()
    assert r["tokens"] == plain and r["count"] == len(plain)
    assert post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == model.encode_prompt(text)
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain and "".join(p["piece"] for p in pieces) == text
    assert post(server, "/detokenize", {"tokens": plain}).json()["content"] == text


def test_tokenize_in_vllms_shape_with_the_chat_template(server, model):
    text = "Hello world"
    r = post(server, "/tokenize", {"prompt": text, "model": NAME}).json()
    assert r["tokens"] == model.encode_prompt(text) and r["max_model_len"] == 256 and r["count"] == len(r["tokens"])
    assert post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == \
        model.tokenizer.encode(text, add_special_tokens=False)
    chat = post(server, "/tokenize", {"messages": MSGS}).json()
    assert chat["tokens"] == model.tokenizer.encode(model.apply_chat_template(MSGS), add_special_tokens=False)
    bare = post(server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert bare["tokens"] == model.tokenizer.encode(model.apply_chat_template(MSGS, add_generation_prompt=False),
                                                    add_special_tokens=False)
    strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == [model.tokenizer.id_to_token(t) for t in strs["tokens"]]
    assert post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"] == model.apply_chat_template(MSGS)
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == model.tokenizer.eos_token and info["chat_template"] == model.tokenizer.chat_template


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "content"), ("/tokenize", {"content": 5}, "content"), ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"content": "a", "prompt": "a"}, "content"), ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"content": "x"}]}, "messages[0]"), ("/tokenize", {"content": "a", "add_special": "no"}, "add_special"),
    ("/tokenize", {"content": "a", "with_peices": True}, "with_peices"), ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"), ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": [1], "text": "x"}, "text"),
])
def test_bad_tokenize_requests_are_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
