"""Tool calling and structured output through the real server and the official ``openai`` client:
tools rendered by the model's template, replies parsed into ``tool_calls`` (whole and streamed),
forced calls and ``response_format`` schemas that always validate on random weights, and requests
refused by name."""

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

import slotinfer
from slotinfer import request, tools
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

NAME = "tiny"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A city's forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}
HISTORY = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

landed = pytest.mark.skipif("grammar" not in request.PARAMS, reason="the library's constraint parameters")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def served(request, model_dir):
    """(model, openai client) for one family: qwen3 answers in <tool_call> blocks, llama in Llama 3.1 JSON."""
    model = slotinfer.load(model_dir(request.param))
    with slotinfer.Inferencer(model, slots=8, max_len=1024, max_queue=64) as inf:
        with serving(build_app(inf, served_model_name=NAME)) as url:
            yield model, openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)


def test_tools_reach_the_prompt_and_a_reply_without_calls_is_content(served):
    model, client = served
    want = model.generate(tools.render(model, MSGS, TOOLS), max_tokens=12)
    assert "<tool_call>" not in want.text and not want.text.lstrip().startswith("{")
    r = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert (msg.content, msg.tool_calls) == (want.text.strip() or None, None)
    plain = model.generate(model.chat_prompt(messages=MSGS), max_tokens=1)
    assert r.usage.prompt_tokens == want.prompt_tokens > plain.prompt_tokens
    streamed = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, max_tokens=12, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (msg.content or "")


def test_tool_choice_none_leaves_the_tools_out(served):
    model, client = served
    want = model.generate(model.chat_prompt(messages=MSGS), max_tokens=8)
    r = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == want.prompt_tokens


def test_a_conversation_with_tool_results_renders(served):
    model, client = served
    want = model.generate(tools.render(model, HISTORY, TOOLS), max_tokens=6)
    r = client.chat.completions.create(model=NAME, messages=HISTORY, tools=TOOLS, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == want.prompt_tokens


def _bad(client, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=kw.pop("messages", MSGS), max_tokens=4, **kw)
    return e.value.body


@pytest.mark.parametrize("kw, param, words", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "does not list"),
    (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice", "'required'"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name", "letters"),
    (dict(tools=[{"type": "function"}]), "tools[0]", "'function'"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools", "more than once"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools[0].function.parameters",
     "JSON Schema"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "constrains the output"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a+"}}),
     "structured_outputs.regex", "both constrain"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["x"]}), "guided_choice", "both constrain"),
    (dict(response_format={"type": "xml"}), "response_format", "json_schema"),
    (dict(extra_body={"structured_outputs": {"yaml": "x"}}), "structured_outputs.yaml", "json, regex"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs.choice", "list of strings"),
    (dict(logit_bias={"the": 5}), "logit_bias", "token ids"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          tool_choice="required"), "tools", "do not compile"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
          tool_choice="required"), "tools[0].function.parameters", "a JSON object"),
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": ["array", "null"]}}}],
          tool_choice={"type": "function", "function": {"name": "f"}}), "tools[1].function.parameters", "forced"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"enum": [1, 2]}}}],
          tool_choice="required"), "tools", "do not compile"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format", "not valid"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex", "not valid"),
    (dict(extra_body={"functions": [{"name": "f"}]}), "functions", "'tools'"),
    (dict(messages=[*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    *[(dict(messages=[*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": ' * n + "1" + "}" * n}}]}]),
       "messages[1].tool_calls[0].function.arguments", "nests deeper") for n in (65, 5000)],
])
def test_bad_tool_and_constraint_fields_are_400_naming_them(served, kw, param, words):
    err = _bad(served[1], **kw)
    assert err["param"] == param and words in err["message"], err


def test_parameters_that_are_no_object_are_taken_where_the_call_is_not_forced(served):
    _, client = served
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    for kw in (dict(tools=[odd]), dict(tools=[odd, TOOLS[1]], tool_choice={"type": "function",
                                                                           "function": {"name": "get_time"}})):
        r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=30, temperature=0, **kw)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# -- with the library's constraints --------------------------------------------------------

def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@landed
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_always_parses_and_validates(served, choice):
    """Random weights, sampled: constrained by the function's schema, every reply is a call that validates."""
    _, client = served
    r = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice=choice, n=6,
                                       temperature=1.0, seed=7, max_tokens=200, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        [(name, args)] = _calls(c.message)
        assert name == "get_time" if isinstance(choice, dict) else name in SCHEMAS
        jsonschema.validate(args, SCHEMAS[name])
        assert all(t.id.startswith("call_") and t.type == "function" for t in c.message.tool_calls)


@landed
def test_parallel_calls_each_validate(served):
    """With parallel calls a random model may call until max_tokens: every whole call validates, the cut one
    stays text, and the finish reason says the reply was cut."""
    _, client = served
    r = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required", n=4,
                                       temperature=1.0, seed=5, max_tokens=120)
    for c in r.choices:
        calls = _calls(c.message)
        assert calls and c.finish_reason == ("length" if c.message.content else "tool_calls"), c
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])
        assert c.message.content is None or c.message.content.startswith("<tool_call>") or c.finish_reason == "length"


def _streamed_calls(chunks) -> tuple[list, list, str]:
    """(calls as (name, arguments), finish reasons, content) of a streamed chat reply."""
    calls, reasons, content = {}, [], ""
    for chunk in chunks:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    return [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], reasons, content


@landed
def test_a_forced_reply_stops_at_a_repeated_call(served):
    """With the end token banned, a forced reply of a function without arguments can only repeat its one
    call: it ends at the first repeat, which is dropped, well before max_tokens, whole and streamed."""
    model, client = served
    ping = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                             "additionalProperties": False}}}]
    kw = dict(model=NAME, messages=MSGS, tools=ping, tool_choice="required", max_tokens=300, temperature=0,
              logit_bias={str(t): -100 for t in model.eos_ids})
    r = client.chat.completions.create(**kw)
    [c] = r.choices
    assert (_calls(c.message), c.finish_reason, c.message.content) == ([("ping", {})], "tool_calls", None)
    assert r.usage.completion_tokens < 150
    calls, reasons, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert (calls, reasons[-1], content) == ([("ping", {})], "tool_calls", "")
    r = client.chat.completions.create(**{**kw, "max_tokens": 60}, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


@landed
def test_streamed_calls_assemble_into_the_whole_replys(served):
    _, client = served
    kw = dict(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            assert not c.delta.content  # a forced call has no content
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert got == _calls(whole.choices[0].message) and got
    assert all(e["id"].startswith("call_") for e in calls.values())
    assert reasons[-1] == whole.choices[0].finish_reason == "tool_calls"


@landed
def test_response_format_json_schema_validates(served):
    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=MSGS, response_format=fmt, n=4, temperature=1.0, seed=3,
                                       max_tokens=200)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), WEATHER)
    r = client.chat.completions.create(model=NAME, messages=MSGS, response_format={"type": "json_object"},
                                       max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@landed
def test_vllm_structured_outputs(served):
    _, client = served
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, n=3, temperature=1.0, seed=1,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert {c.message.content for c in r.choices} <= {"yes", "no", "maybe"}
    r = client.completions.create(model=NAME, prompt="Digits:", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": "[0-9]{3}-[0-9]{2}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", r.choices[0].text)
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": 'start: "a" | "b" "c"'}})
    assert r.choices[0].message.content in ("a", "bc")


@landed
def test_logit_bias_and_penalties_reach_the_step(served):
    model, client = served
    token = model.tokenizer.encode("x", add_special_tokens=False)[0]
    r = client.completions.create(model=NAME, prompt="Once", max_tokens=5, temperature=0, logit_bias={str(token): 100},
                                  extra_body={"ignore_eos": True}, logprobs=0)
    assert r.choices[0].text == model.tokenizer.decode([token] * 5)
    r = client.completions.create(model=NAME, prompt="Once", max_tokens=5, temperature=0, presence_penalty=1.5,
                                  frequency_penalty=-0.5)
    assert r.usage.completion_tokens >= 1


@landed
def test_the_tool_calling_page_runs(smollm2, capsys):
    """docs/tool-calling.md's openai example, as written but for the port, against SmolLM2."""
    page = (Path(__file__).parent.parent / "docs" / "tool-calling.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "openai" in b]
    with slotinfer.Inferencer(smollm2, slots=2, max_len=2048) as inf:
        with serving(build_app(inf, served_model_name="smollm2")) as url:
            assert "http://127.0.0.1:8000" in block
            scope = {}
            exec(compile(block.replace("http://127.0.0.1:8000", url), "tool-calling.md", "exec"), scope)
            # greedy, SmolLM2 calls for Paris twice, then would again until max_tokens: the repeat is dropped
            r = scope["client"].chat.completions.create(model="smollm2", messages=scope["messages"][:1],
                                                        tools=scope["tools"], tool_choice="required", temperature=0,
                                                        max_tokens=200)
    first, *rest = capsys.readouterr().out.splitlines()
    assert first.startswith("get_weather {'city': ") and rest, first
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})] and r.choices[0].finish_reason == "tool_calls"
    turns = scope["messages"]  # every call of the first reply got its tool turn
    assert [m["tool_call_id"] for m in turns if m["role"] == "tool"] == [c["id"] for c in turns[1]["tool_calls"]]
