"""Tolerant of the specs, strict about typos: the fields other APIs and servers send are accepted
(ignored where they change nothing, mapped where they mean something here, refused by name where
slotinfer cannot honour the value sent) on every generation endpoint, and a field in no one's schema
is still a 400 with the close match."""

import json

import anthropic
import openai
import pytest

import slotinfer
from slotinfer.serve import build_app
from slotinfer.serve.background import serving
from slotinfer.serve.tolerated import IGNORED, NEUTRAL

NAME = "tiny"
MSGS = [{"role": "user", "content": "Name a colour."}]
# a value of each ignored field as its own API sends it
_VALUES = {"metadata": {"k": "v"}, "samplers": ["top_k", "temperature"], "dry_sequence_breakers": ["\n"],
           "prediction": {"type": "content", "content": "x"}, "stop_token_ids": [], "vllm_xargs": {},
           "kv_transfer_params": {}, "mm_processor_kwargs": {}, "response_fields": ["content"]}


def _ignored():
    return {name: _VALUES.get(name, 1 if name not in ("user", "store", "cache_prompt", "verbosity") else
                              {"user": "u", "store": False, "cache_prompt": True, "verbosity": "low"}[name])
            for name in IGNORED}


@pytest.fixture(scope="module")
def server(model_dir):
    model = slotinfer.load(model_dir("qwen3"))
    with slotinfer.Inferencer(model, slots=4, max_len=512, max_queue=16) as inf:
        with serving(build_app(inf, served_model_name=NAME)) as url:
            yield url, model


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="-", max_retries=0, timeout=120)


def test_every_ignored_and_neutral_field_is_accepted_on_every_endpoint(oai, claude):
    extra = {**_ignored(), **{name: values[0] for name, values in NEUTRAL.items()}, "ignore_eos": True}
    chat = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, extra_body=extra)
    done = oai.completions.create(model=NAME, prompt="Once", max_tokens=2, extra_body=extra)
    resp = oai.responses.create(model=NAME, input="Once", max_output_tokens=2, extra_body=extra)
    msg = claude.messages.create(model=NAME, max_tokens=2, messages=MSGS, extra_body=extra)
    assert [chat.usage.completion_tokens, done.usage.completion_tokens, resp.usage.output_tokens,
            msg.usage.output_tokens] == [2, 2, 2, 2]


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_a_field_slotinfer_cannot_honour_is_a_400_naming_it(oai, claude, name):
    other = {list: ["audio"], type(None): "x", bool: not NEUTRAL[name][0], int: 3, float: 0.5,
             str: "x"}[type(NEUTRAL[name][0])]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, extra_body={name: other})
    assert e.value.body["param"] == name and "not supported" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=NAME, max_tokens=2, messages=MSGS, extra_body={name: other})
    assert e.value.body["error"]["message"].startswith(name)


def test_llama_cpp_and_vllm_fields_mean_what_they_mean_there(oai, server):
    _, model = server
    greedy = {"temperature": 0, "ignore_eos": True}
    # n_predict is max_tokens; repeat_penalty is repetition_penalty
    r = oai.completions.create(model=NAME, prompt="Once upon", extra_body={"n_predict": 5, **greedy})
    assert r.usage.completion_tokens == 5
    a = oai.completions.create(model=NAME, prompt="Once upon", max_tokens=12,
                               extra_body={"repeat_penalty": 1.8, **greedy})
    b = oai.completions.create(model=NAME, prompt="Once upon", max_tokens=12,
                               extra_body={"repetition_penalty": 1.8, **greedy})
    want = model.generate("Once upon", max_tokens=12, repetition_penalty=1.8, ignore_eos=True)
    assert a.choices[0].text == b.choices[0].text == want.text
    # llama.cpp's json_schema constrains as response_format does
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    j = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=40, extra_body={"json_schema": schema,
                                                                                          "temperature": 0})
    assert isinstance(json.loads(j.choices[0].message.content)["n"], int)
    # top_k, min_p, mlx-lm's repetition_context_size and a reasoning_effort are taken
    r = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, reasoning_effort="low",
                                    extra_body={"top_k": 5, "min_p": 0.1, "repetition_context_size": 20})
    assert r.usage.completion_tokens >= 1


def test_enable_thinking_reaches_the_template(oai, claude, server):
    _, model = server
    off = model.apply_chat_template(MSGS, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    want = len(model.encode_prompt(off))
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False},
                  {"reasoning_effort": "none"}):
        r = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=1, extra_body=extra)
        assert r.usage.prompt_tokens == want, extra
    assert oai.responses.create(model=NAME, input=MSGS, max_output_tokens=1,
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                                ).usage.input_tokens == want
    assert claude.messages.count_tokens(model=NAME, messages=MSGS,
                                        thinking={"type": "disabled"}).input_tokens == want
    for bad, words in (({"chat_template_kwargs": {"messages": []}}, "may not set"),
                       ({"chat_template_kwargs": "x"}, "object"), ({"reasoning_effort": "max"}, "one of")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=1, extra_body=bad)
        assert words in e.value.body["message"], e.value.body


@pytest.mark.parametrize("kind", ["chat", "completions", "responses", "messages"])
def test_a_field_in_no_ones_schema_is_still_a_400_with_the_close_match(oai, claude, kind):
    typo = {"cache_promt": True}
    if kind == "messages":
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=NAME, max_tokens=2, messages=MSGS, extra_body=typo)
        message = e.value.body["error"]["message"]
    else:
        with pytest.raises(openai.BadRequestError) as e:
            {"chat": lambda: oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, extra_body=typo),
             "completions": lambda: oai.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body=typo),
             "responses": lambda: oai.responses.create(model=NAME, input="x", max_output_tokens=2, extra_body=typo),
             }[kind]()
        assert e.value.body["param"] == "cache_promt"
        message = e.value.body["message"]
    assert "did you mean 'cache_prompt'" in message, message
