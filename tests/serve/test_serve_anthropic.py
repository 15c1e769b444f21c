"""Anthropic's Messages API through the real server and the official ``anthropic`` client: the same
tokens as a chat completion of the same conversation, the event stream (read by the SDK's own
accumulator), tools with ``tool_use`` / ``tool_result`` blocks, ``stop_reason``, count_tokens, keys,
and bad input refused in Anthropic's error shape while the server keeps serving."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

import slotinfer
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

NAME = "tiny"
KEY = "sk-test"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "A city's forecast", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A city's forecast",
                                                "parameters": WEATHER}}]
USER = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}  # a field this SDK version no longer lists, as older clients (and Claude Code) send it


@pytest.fixture(scope="module")
def server(model_dir):
    model = slotinfer.load(model_dir("qwen3"))
    with slotinfer.Inferencer(model, slots=4, max_len=1024, max_queue=16) as inf:
        with serving(build_app(inf, served_model_name=NAME, api_key=KEY, max_body_bytes=1 << 16)) as url:
            yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_a_message_is_the_chat_completion_of_the_same_conversation(client, oai):
    m = client.messages.create(model=NAME, max_tokens=12, system="Be brief.", messages=USER, extra_body=GREEDY)
    want = oai.chat.completions.create(model=NAME, messages=[{"role": "system", "content": "Be brief."}, *USER],
                                       max_tokens=12, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == NAME and m.id.startswith("msg_")
    assert "".join(b.text for b in m.content if b.type == "text") == want.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert m.usage.output_tokens == want.usage.completion_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]


def test_blocks_render_as_the_chat_messages_they_stand_for(client, oai):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris", "days": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    m = client.messages.create(model=NAME, max_tokens=6, system=system, messages=messages, tools=TOOLS,
                               extra_body=GREEDY)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]
    want = oai.chat.completions.create(model=NAME, messages=chat, tools=CHAT_TOOLS, max_tokens=6, extra_body=GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    text = "".join(b.text for b in m.content if b.type == "text")
    assert (text or None) == want.choices[0].message.content
    count = client.messages.count_tokens(model=NAME, system=system, messages=messages, tools=TOOLS)
    assert count.input_tokens == want.usage.prompt_tokens


def test_the_stream_is_anthropics_event_sequence_and_equals_the_whole(client):
    kw = dict(model=NAME, max_tokens=16, messages=[{"role": "user", "content": "Tell me a story."}], extra_body=GREEDY)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:3] == ["content_block_start", "content_block_delta"] and kinds[-3] == "content_block_stop"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == 16
    with client.messages.stream(**kw) as stream:  # the SDK's own accumulator
        assert "".join(stream.text_stream) == text
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_is_a_tool_use_block(client, stream):
    kw = dict(model=NAME, max_tokens=120, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kw) as s:
            deltas = [e for e in s if e.type == "content_block_delta"]
            m = s.get_final_message()
        assert any(d.delta.type == "input_json_delta" for d in deltas)
    else:
        m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1, m
    assert uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    named = client.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]


def test_stop_sequences_say_which_one_ended_the_reply(client):
    base = dict(model=NAME, max_tokens=24, messages=USER, extra_body=GREEDY)
    text = client.messages.create(**base).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    m = client.messages.create(stop_sequences=["\x00never", stop], **base)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, (text, m)
    assert m.content[0].text == text[:text.index(stop)]


def test_output_format_constrains_the_reply_to_the_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    m = client.messages.create(model=NAME, max_tokens=40, messages=USER,
                               output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_x_api_key_and_bearer_are_both_taken_and_a_wrong_key_is_401(server):
    body = {"model": NAME, "max_tokens": 2, "messages": USER}
    assert httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60).status_code == 200
    assert httpx.post(server + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60).status_code == 200
    assert httpx.get(server + "/v1/models", headers={"x-api-key": KEY}, timeout=60).status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
        "error"]["message"]}}


@pytest.mark.parametrize("body, words", [
    ({"messages": USER}, "'max_tokens' is required"),
    ({"max_tokens": 4}, "'messages' must be"),
    ({"max_tokens": 4, "messages": "hi"}, "'messages' must be"),
    ({"max_tokens": "4", "messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 4, "messages": USER, "system": 5}, "system"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"max_tokens": 4, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "does not list"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": 4, "messages": USER, "temperature": "hot"}, "temperature"),
    ({"max_tokens": 4, "messages": USER, "max_tokns": 4}, "did you mean 'max_tokens'"),
])
def test_bad_input_is_a_400_in_anthropics_shape(client, body, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": NAME, **body}, cast_to=object)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert words in err["error"]["message"], err


def test_unknown_model_oversize_and_broken_bodies_then_it_still_serves(client, server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus-4", messages=USER)
    head = {"x-api-key": KEY}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server + path, json={"model": NAME, "max_tokens": 4, "messages": [
            {"role": "user", "content": "x" * (1 << 17)}]}, headers=head, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
        r = httpx.post(server + path, content=b"[1, 2", headers=head, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=NAME, messages=[])
    assert "'messages'" in e.value.body["error"]["message"]
    assert client.messages.create(model=NAME, max_tokens=2, messages=USER).usage.output_tokens >= 1


def test_fields_that_change_nothing_here_are_accepted(client):
    m = client.messages.create(model=NAME, max_tokens=2, messages=USER, metadata={"user_id": "u"},
                               service_tier="auto", thinking={"type": "disabled"}, cache_control={"type": "ephemeral"},
                               extra_body={"cache_prompt": True, "min_p": 0.05, "repetition_context_size": 20,
                                           "top_k": 5, "temperature": 0.5, "top_p": 0.9})
    assert m.usage.output_tokens >= 1


def test_a_system_turn_mid_conversation_is_rendered_as_one(client, oai):
    """Claude Code sends system turns among the messages (its mid-conversation system beta)."""
    messages = [*USER, {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}]
    count = client.messages.count_tokens(model=NAME, messages=messages)
    want = oai.chat.completions.create(model=NAME, messages=[*USER, {"role": "system", "content": "Answer in French."}],
                                       max_tokens=1)
    assert count.input_tokens == want.usage.prompt_tokens
