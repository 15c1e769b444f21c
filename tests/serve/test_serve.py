"""The OpenAI-compatible server as clients see it: the real server (uvicorn on 127.0.0.1, an
ephemeral port) over a tiny real model, driven by the official ``openai`` package."""

import json

import httpx
import openai
import pytest
from hypothesis import given, strategies as st

import slotinfer
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

NAME = "tiny"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def model(model_dir):
    return slotinfer.load(model_dir("qwen3"))


@pytest.fixture(scope="module")
def server(model):
    """(base url, inferencer): one server for the module's tests."""
    with slotinfer.Inferencer(model, slots=8, max_len=256, max_queue=64) as inf:
        with serving(build_app(inf, served_model_name=NAME)) as url:
            yield url, inf


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_is_the_models_greedy_output(client, model):
    want = model.generate("Once upon a time", max_tokens=12)
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    [choice] = r.choices
    assert (choice.text, choice.index) == (want.text, 0)
    assert choice.finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, len(want.tokens))
    assert r.usage.total_tokens == want.prompt_tokens + len(want.tokens)
    assert r.model == NAME and r.id.startswith("cmpl-") and r.object == "text_completion"


def test_prompt_forms_and_n_give_prompt_major_choices(client, model):
    ids = model.tokenizer.encode("The sea")
    prompts = ["A cat", "The sea"]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    wants = [model.generate(p, max_tokens=6, ignore_eos=True).text for p in prompts]
    assert [c.text for c in r.choices] == [wants[0], wants[0], wants[1], wants[1]]
    r2 = client.completions.create(model=NAME, prompt=[ids, ids[:2]], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r2.choices[0].text == wants[1]
    assert r2.choices[1].text == model.generate(ids[:2], max_tokens=6, ignore_eos=True).text
    assert r2.usage.prompt_tokens == len(ids) + 2


def test_seeded_rows_are_reproducible_and_distinct(client, model):
    kw = dict(model=NAME, prompt="Seeds", max_tokens=10, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # row j draws with seed + j
    assert a.choices[1].text == model.generate("Seeds", max_tokens=10, temperature=1.0, seed=8, ignore_eos=True).text


def test_chat_uses_the_models_template_and_no_special_tokens(client, model):
    want = model.chat(MSGS, max_tokens=20, ignore_eos=True)
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(model.tokenizer.encode(model.apply_chat_template(MSGS)))
    specials = [model.tokenizer.id_to_token(i) for i in model.tokenizer._special_ids]
    raw = model.chat(MSGS, max_tokens=40, ignore_eos=True, skip_special_tokens=False).text
    text = model.chat(MSGS, max_tokens=40, ignore_eos=True).text
    assert not any(s in text for s in specials)
    if any(t in model.tokenizer._special_ids for t in model.chat(MSGS, max_tokens=40, ignore_eos=True).tokens):
        assert any(s in raw for s in specials)


def test_chat_stream_equals_the_whole_answer_and_reports_usage(client):
    kw = dict(model=NAME, messages=MSGS, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage(client, model):
    chunks = list(client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == model.generate("Hello", max_tokens=8).text
    assert all(c.usage is None for c in chunks)


def test_logprobs_in_both_formats_are_the_engines(client, server, model):
    inf = server[1]
    want = inf.generate("Once upon a time", max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs)
    assert lp.tokens == [model.tokenizer.decode([t]) for t in want.tokens]
    assert [len(t) for t in lp.top_logprobs] == [len({model.tokenizer.decode([i]) for i, _ in top}) for top in want.top_logprobs]
    assert lp.text_offset[0] == 0
    chat_want = inf.generate(messages=MSGS, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=2)
    c = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    # each token's exact bytes (a byte-level token may hold part of a character): together, the text
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == model.tokenizer.decode(chat_want.tokens)
    # the same tokens; logprobs to float32 rounding, since one of the two may reuse the other's prompt
    # K/V from the prefix cache and compute only its rest (as a chunked prefill does)
    assert [e.logprob for e in content] == pytest.approx(chat_want.logprobs, rel=1e-5)
    assert [t.logprob for e in content for t in e.top_logprobs] == pytest.approx(
        [v for top in chat_want.top_logprobs for _, v in top], rel=1e-5)
    streamed = [ch.choices[0].logprobs.content[0].logprob for ch in client.chat.completions.create(
        model=NAME, messages=MSGS, max_tokens=5, temperature=0, logprobs=True, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs]
    assert streamed == pytest.approx(chat_want.logprobs)


def test_stop_strings_end_the_text(client, model):
    ref = model.generate("Once upon a time", max_tokens=30, ignore_eos=True).text
    stop = ref[8:10]
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref[: ref.find(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed=-3), "seed"), (dict(stop=[""]), "stop"), (dict(logprobs=99), "logprobs"),
    (dict(extra_body={"top_k": -1}), "top_k"), (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"), (dict(extra_body={"ignore_eos": "yes"}), "ignore_eos"),
])
def test_invalid_parameters_are_400_naming_them(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", **kw)
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_errors_map_to_the_clients_exceptions(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:  # over the slot's max_len (256) with its max_tokens
        client.completions.create(model=NAME, prompt="hi " * 400, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and "max_len" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # over the model's context (2048) alone
        client.completions.create(model=NAME, prompt=[5] * 2100, max_tokens=4)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"content": "no role"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=[10**7])  # outside the vocabulary
    r = httpx.post(server[0] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server[0] + "/v1/nothing").status_code == 404


def test_api_key_is_required_when_configured(model):
    with slotinfer.Inferencer(model, slots=2, max_len=64) as inf, \
            serving(build_app(inf, served_model_name=NAME, api_key="sk-right")) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sk-right", max_retries=0)
        assert [m.id for m in good.models.list()] == [NAME]
        assert good.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(url + "/health").status_code == 200  # probes need no key


def test_health_models_and_metrics(client, server):
    url, inf = server
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).model_dump() == client.models.list().data[0].model_dump()
    for other in ("gpt-4o", "org/other-model", NAME + "x"):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(other)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model", e.value.body
    client.completions.create(model=NAME, prompt="count me", max_tokens=3, temperature=0)
    text = httpx.get(url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['slotinfer_requests_total{endpoint="completions",outcome="ok"}'] >= 1
    assert values["slotinfer_generation_tokens_total"] >= 3 and values["slotinfer_prompt_tokens_total"] >= 2
    assert values["slotinfer_time_to_first_token_seconds_count"] >= 1
    assert values["slotinfer_inter_token_latency_seconds_count"] >= 2
    assert {"slotinfer_requests_running", "slotinfer_requests_waiting", "slotinfer_decode_tokens_per_second",
            "slotinfer_prefill_tokens_per_second"} <= set(values)
    blocks = inf.memory()["blocks"]
    assert values["slotinfer_kv_blocks_used"] + values["slotinfer_kv_blocks_free"] == blocks > 0
    assert values["slotinfer_kv_block_tokens"] == inf.memory()["block_tokens"]
    assert values["slotinfer_preempted_total"] == inf.stats()["preempted"] == 0


def test_a_request_the_kv_pool_cannot_hold_is_a_400_naming_max_tokens(model):
    """A pool of one usable block: a request whose prompt and max_tokens need more is refused at
    submit with 400 (never 429, it would never fit), naming max_tokens; one that fits is served."""
    cfg = model.config
    block = 2 * cfg.num_layers * cfg.num_kv_heads * 128 * cfg.head_dim * 4
    with slotinfer.Inferencer(model, slots=2, max_len=512, kv_cache_bytes=3 * block) as inf, \
            serving(build_app(inf, served_model_name=NAME)) as url:
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 300}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "kv_cache_bytes" in r.json()["error"]["message"]
        ok = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_classify_is_the_librarys(server, model):
    body = {"model": NAME, "input": ["I loved it", "Awful food"], "labels": ["good", "bad"], "prefix": "Review: ",
            "label_prefix": " "}
    r = httpx.post(server[0] + "/v1/classify", json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = model.classify(body["input"], labels=body["labels"], prefix="Review: ", label_prefix=" ")
    got = r.json()
    assert [d["index"] for d in got["data"]] == [0, 1]
    assert [d["label"] for d in got["data"]] == [w.label for w in want]
    for d, w in zip(got["data"], want):
        assert d["scores"] == pytest.approx(w.scores, abs=1e-5)
    assert got["usage"]["prompt_tokens"] == sum(w.prompt_tokens for w in want)
    assert httpx.post(server[0] + "/v1/classify", json={"input": ["x"], "labels": []}).json()["error"]["param"] == "labels"


@given(prompt=st.one_of(st.text(min_size=1, max_size=40).filter(str.strip),
                        st.lists(st.integers(0, 511), min_size=1, max_size=20)),
       max_tokens=st.integers(1, 24), chat=st.booleans())
def test_greedy_output_through_http_is_model_generate(client, model, prompt, max_tokens, chat):
    if chat:
        if not isinstance(prompt, str):
            prompt = model.tokenizer.decode(prompt) or "x"
        msgs = [{"role": "user", "content": prompt}]
        want = model.chat(msgs, max_tokens=max_tokens)
        r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=max_tokens, temperature=0)
        got = r.choices[0].message.content
    else:
        want = model.generate(prompt, max_tokens=max_tokens)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        got = r.choices[0].text
    assert got == want.text and r.usage.completion_tokens == len(want.tokens)
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")


def test_json_bodies_are_plain_objects(server):
    r = httpx.post(server[0] + "/v1/chat/completions", content=json.dumps([1, 2]))
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_stream_events_carry_logprobs_only_when_asked(model):
    with slotinfer.Inferencer(model, slots=2, max_len=64) as inf:
        a = inf.submit("one", max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
        b = inf.submit("two", max_tokens=8, ignore_eos=True)  # shares every step with a
        ea, eb = list(a), list(b)
    assert [e.logprob for e in ea] == pytest.approx(a.result().logprobs)
    assert [e.top_logprobs for e in ea] == a.result().top_logprobs and all(len(e.top_logprobs) == 2 for e in ea)
    assert all(e.logprob is None and e.top_logprobs is None for e in eb) and len(eb) == 8


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.sampled_from([2**40, -2**40]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.lists(st.integers(-1, 600), max_size=4), st.lists(st.text(max_size=4), max_size=3),
                    st.dictionaries(st.sampled_from(["include_usage", "type", "x"]), st.booleans(), max_size=2))
_PARAMS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
           "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "n", "logprobs",
           "top_logprobs", "ignore_eos", "skip_special_tokens", "stop_token_ids", "stream", "stream_options",
           "echo", "best_of", "response_format", "model", "user", "logit_bias", "structured_outputs", "tools",
           "tool_choice", "parallel_tool_calls"]


@given(body=st.dictionaries(st.sampled_from(_PARAMS), _VALUES, max_size=8), chat=st.booleans(),
       base=st.booleans())
def test_any_body_is_answered_or_refused_by_name(server, body, chat, base):
    """Whatever a client sends, the answer is a result or a 4xx naming what was wrong: never a 500."""
    if base:  # a valid core, so that the other fields are what gets judged
        body.setdefault("messages" if chat else "prompt", [{"role": "user", "content": "hi"}] if chat else "hi")
    if isinstance(body.get("n"), int) and body.get("n", 1) > 4:
        body["n"] = 4
    r = httpx.post(server[0] + ("/v1/chat/completions" if chat else "/v1/completions"), timeout=120,
                   content=json.dumps(body), headers={"content-type": "application/json"})  # NaN, Infinity too
    if r.status_code == 200:
        if body.get("stream") is True:
            assert r.text.endswith("data: [DONE]\n\n")
        else:  # echo with max_tokens 0 scores the prompt alone
            scoring = body.get("echo") is True and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int
            assert r.json()["usage"]["completion_tokens"] >= (0 if scoring else 1)
        return
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["message"] and set(err) == {"message", "type", "param", "code"}


def test_json_nested_too_deep_is_400(server):
    r = httpx.post(server[0] + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "model": "m" * 1_000_000}),
    ("/v1/completions", {"prompt": "hi", "n": "x" * 100_000}),
    ("/v1/completions", {"prompt": "hi", "x" * 100_000: 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["y" * 100_000]}]}),
    ("/v1/classify", {"input": ["a"], "labels": "z" * 100_000}),
    ("/v1/" + "p" * 20_000, {}),
])
def test_error_messages_echo_at_most_a_few_hundred_characters_of_the_request(server, path, body):
    r = httpx.post(server[0] + path, json=body, timeout=60)
    assert r.status_code in (400, 404) and len(r.text) < 600, r.text[:1000]


def test_vocabulary_bounds_name_their_parameter(client, model):
    vocab = model.config.vocab_size
    for extra in ({"top_k": vocab + 1}, {"stop_token_ids": [vocab]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra)), e.value.body


def test_max_tokens_past_the_slot_quotes_the_clients_figure(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=1_000_000)
    err = e.value.body
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded", err
    assert "1000000" in err["message"] and "1000003" in err["message"] and "253" in err["message"], err


def test_the_engines_refusal_names_the_clients_key(client):
    """The engine's one rule, worded with the key the client sent, and the prompt named when it alone
    leaves no room."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSGS, max_completion_tokens=1_000_000)
    err = e.value.body
    assert err["param"] == "max_completion_tokens" and "lower max_completion_tokens (to at most" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi " * 400}], max_tokens=4)
    err = e.value.body
    assert err["param"] == "messages" and "shorten the prompt to at most 255 tokens" in err["message"], err
    assert "at most 0" not in err["message"]


@pytest.mark.parametrize("path, body, field, hint", [
    ("/v1/completions", {"prompt": "hi", "max_tokns": 3}, "max_tokns", "max_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "temprature": 0}, "temprature", "temperature"),
    ("/v1/classify", {"input": ["a"], "labels": ["x", "y"], "lables": ["x"]}, "lables", "labels"),
])
def test_unknown_fields_are_400_naming_them(server, path, body, field, hint):
    r = httpx.post(server[0] + path, json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and f"did you mean '{hint}'" in err["message"], r.text


def test_fields_that_change_nothing_here_are_accepted(client):
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, user="u1", store=False,
                                       metadata={"k": "v"}, service_tier="auto", tool_choice="none",
                                       extra_body={"functions": None, "logit_bias": {}})
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("path, name", [
    ("models/Qwen3-0.6B", "Qwen3-0.6B"), ("x/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct"), ("gemma-2-2b.BF16.gguf", "gemma-2-2b"),
    ("Phi-3-mini-4k-instruct-fp16.gguf", "Phi-3-mini-4k-instruct"), ("model-135M.gguf", "model-135M"),
    ("hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/0123abc", "HuggingFaceTB/SmolLM2-135M-Instruct"),
])
def test_the_default_served_name_is_clean(path, name):
    from pathlib import Path

    from slotinfer.serve.app import default_name

    assert default_name(Path(path)) == name


def test_max_completion_tokens_is_taken_by_both_endpoints(client):
    r = client.completions.create(model=NAME, prompt="hi", extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_cached_tokens_are_reported_and_exported(client, server, model):
    """A repeated system prompt hits the prefix cache: usage says how many prompt tokens it served,
    streamed or not, the metrics count the hits, and a different cache_salt shares nothing."""
    url, inf = server
    system = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 6}
    msgs = [system, {"role": "user", "content": "Name a fruit."}]
    # a salt of its own: the module's other requests share the template's first tokens, and a hit
    # reuses every token a prompt shares with a cached one, not only whole blocks
    own = {"cache_salt": "cached-tokens-test"}
    first = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, temperature=0, extra_body=own)
    again = client.chat.completions.create(model=NAME, messages=[system, {"role": "user", "content": "Name a tree."}],
                                           max_tokens=3, temperature=0, extra_body=own)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert 128 <= hit < again.usage.prompt_tokens  # the system prompt and the start of the user's turn
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=own))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= hit
    salted = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, temperature=0,
                                            extra_body={"cache_salt": "another tenant"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == first.choices[0].message.content
    text = httpx.get(url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    st_ = inf.stats()["prefix_cache"]
    assert values["slotinfer_prefix_cache_hit_tokens_total"] >= 2 * hit
    assert values["slotinfer_prefix_cache_bytes"] > 0 and values["slotinfer_prefix_cache_queries_total"] >= 4
    assert st_["evictions"] == values["slotinfer_prefix_cache_evictions_total"]


def test_a_bad_cache_salt_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"cache_salt": 5})
    assert e.value.body["param"] == "cache_salt"
