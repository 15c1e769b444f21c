"""OpenAI's Responses API (stateless) through the real server and the official ``openai`` client:
the same tokens as a chat completion of the same conversation, the typed event stream, function
tools and their items, ``text.format`` schemas, and bad input refused in the API's own shape."""

import json

import httpx
import jsonschema
import openai
import pytest

import slotinfer
from slotinfer import tools
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

NAME = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "A city's forecast", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A city's forecast",
                                                "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def model(model_dir):
    return slotinfer.load(model_dir("qwen3"))


@pytest.fixture(scope="module")
def server(model):
    with slotinfer.Inferencer(model, slots=4, max_len=1024, max_queue=16) as inf:
        with serving(build_app(inf, served_model_name=NAME, max_body_bytes=1 << 16)) as url:
            yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="-", max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)


def test_a_response_is_the_chat_completion_of_the_same_conversation(client):
    r = client.responses.create(model=NAME, instructions="Be brief.", input="Name a colour.", max_output_tokens=12,
                                temperature=0, store=False)
    want = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
                 max_tokens=12)
    assert r.status in ("completed", "incomplete") and r.object == "response" and r.model == NAME
    assert r.output_text == want.choices[0].message.content
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if want.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_items_render_as_the_chat_messages_they_stand_for(client):
    """Input items (text parts, developer turns, a function call and its output) give the prompt of
    the chat conversation they mean: same prompt tokens, same reply."""
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model=NAME, input=items, tools=TOOLS, max_output_tokens=6, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    want = _chat(client, messages, tools=CHAT_TOOLS, max_tokens=6)
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert (r.output_text or None) == want.choices[0].message.content


def test_the_stream_is_the_typed_event_sequence_and_equals_the_whole(client):
    kw = dict(model=NAME, input="Tell me a story.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_is_a_function_call_item(client, stream):
    kw = dict(model=NAME, input="Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=120,
              parallel_tool_calls=False,
              temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        r = events[-1].response
        args = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(args) == len([i for i in r.output if i.type == "function_call"]) >= 1
        assert [e.type for e in events].count("response.output_item.added") == len(r.output)
    else:
        r = client.responses.create(**kw)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and calls, r.output
    for c in calls:
        assert c.name == "get_weather" and c.call_id.startswith("call_")
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [i.name for i in named.output if i.type == "function_call"][:1] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_constrains_the_output(client, stream):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}},
              "required": ["colour", "n"], "additionalProperties": False}
    kw = dict(model=NAME, input="A colour and a number, as JSON.", max_output_tokens=80, temperature=0,
              text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    if stream:
        with client.responses.stream(**kw) as events:  # the SDK's own accumulator of the events
            r = events.get_final_response()
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)


def test_cached_tokens_are_reported(client):
    system = "You are a careful assistant who answers briefly. " * 8
    client.responses.create(model=NAME, instructions=system, input="Name a fruit.", max_output_tokens=2)
    r = client.responses.create(model=NAME, instructions=system, input="Name a tree.", max_output_tokens=2)
    hit = r.usage.input_tokens_details.cached_tokens
    assert hit >= 32 and hit < r.usage.input_tokens


@pytest.mark.parametrize("kw, param, words", [
    (dict(previous_response_id="resp_1"), "previous_response_id", "send the whole conversation"),
    (dict(input=[]), "input", "non-empty"),
    (dict(input=5), "input", "non-empty"),
    (dict(input=[{"role": "robot", "content": "x"}]), "input[0].role", "'user'"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type", "not supported"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0]",
     "text parts"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]), "input[0].arguments",
     "JSON object"),
    (dict(tools=[{"type": "local_shell"}]), "tools[0].type", "function and namespace tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice", "does not list"),
    (dict(text={"format": {"type": "xml"}}), "text.format", "json_schema"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}), "text.format",
     "not valid"),
    (dict(max_output_tokens="many"), "max_output_tokens", None),
    (dict(temperature="hot"), "temperature", None),
    (dict(extra_body={"max_output_tokns": 3}), "max_output_tokns", "did you mean 'max_output_tokens'"),
])
def test_bad_input_is_a_400_naming_the_field(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": NAME, "input": "hi", "max_output_tokens": 4, **kw})
    err = e.value.body
    assert err["param"] == param and (words is None or words in err["message"]), err


def test_unknown_model_oversize_and_broken_bodies_then_it_still_serves(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="other", input="hi")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(server + "/v1/responses", json={"model": NAME, "input": "x" * (1 << 17)}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server + "/v1/responses", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert client.responses.create(model=NAME, input="hi", max_output_tokens=2).usage.output_tokens >= 1


def test_fields_that_change_nothing_here_are_accepted(client):
    r = client.responses.create(model=NAME, input="hi", max_output_tokens=2, store=False, user="u", metadata={"a": "b"},
                                include=["reasoning.encrypted_content"], reasoning={"effort": "low"},
                                truncation="disabled", service_tier="auto", prompt_cache_key="k",
                                parallel_tool_calls=False, extra_body={"cache_prompt": True, "top_k": 5})
    assert r.usage.output_tokens >= 1


def test_tools_reach_the_prompt(client, model):
    prompt = tools.render(model, [{"role": "user", "content": "hi"}], CHAT_TOOLS)
    r = client.responses.create(model=NAME, input="hi", tools=TOOLS, max_output_tokens=2)
    assert r.usage.input_tokens == len(model.encode_prompt(prompt))


def test_hosted_tools_are_not_offered_and_namespace_tools_are_flattened(client):
    """OpenAI's hosted tools (web_search...) have no server here: they are not offered. A namespace
    tool's functions are offered as functions, and a call of one names its namespace (as Codex sends)."""
    namespace = {"type": "namespace", "name": "weather", "description": "Forecasts", "tools": TOOLS}
    plain = client.responses.create(model=NAME, input="hi", tools=TOOLS, max_output_tokens=1)
    mixed = client.responses.create(model=NAME, input="hi", tools=[{"type": "web_search"}, namespace],
                                    max_output_tokens=1)
    assert mixed.usage.input_tokens == plain.usage.input_tokens
    r = client.responses.create(model=NAME, input="Weather in Paris?", tools=[namespace], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    [call] = [i for i in r.output if i.type == "function_call"]
    assert (call.name, call.namespace) == ("get_weather", "weather")
