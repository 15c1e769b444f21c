"""Tool calling's formats: tools rendered through each family's own template (or the fallback), calls
parsed out of replies whole and streamed in any split, and the grammar that forces a call walked
token by token through llguidance on the model's own tokenizer."""

import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest
from hypothesis import given, strategies as st
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from slotinfer import tools
from slotinfer.tools import HERMES, LLAMA3, StreamParser, parse

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def calls_of(text, fmt):
    content, calls = parse(text, fmt)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


# -- parsing, whole replies -------------------------------------------------------------

def test_hermes_calls_and_the_content_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>')
    assert calls_of(text, HERMES) == ("Let me look.", [("get_weather", {"city": "Paris", "days": 2}),
                                                       ("get_time", {"zone": "CET"})])
    assert calls_of('<tool_call>{"name": "f", "parameters": {}}</tool_call>', HERMES) == (None, [("f", {})])
    assert calls_of('<tool_call>\n{"name": "f", "arguments": {"a": [1]}}\n', HERMES) == (None, [("f", {"a": [1]})])


def test_hermes_text_that_is_no_call_stays_content():
    assert calls_of("  Just words.\n", HERMES) == ("Just words.", [])
    assert calls_of("a < b and <tool", HERMES) == ("a < b and <tool", [])
    broken = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    assert calls_of("x " + broken, HERMES) == ("x " + broken, [])
    assert calls_of('<tool_call>{"arguments": {}}</tool_call>', HERMES)[1] == []  # no name
    assert calls_of("<tool_call>{oops", HERMES) == ("<tool_call>{oops", [])
    assert calls_of("", HERMES) == (None, [])


def test_llama3_json_calls():
    one = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert calls_of(one, LLAMA3) == (None, [("get_time", {"zone": "UTC"})])
    assert calls_of('<|python_tag|>{"name": "f", "arguments": {}}', LLAMA3) == (None, [("f", {})])
    two = ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}\n'
    assert calls_of(two, LLAMA3) == (None, [("f", {"a": 1}), ("g", {})])
    cut = '{"name": "f", "parameters": {}}; {"name": "g", "param'  # max_tokens ran out in the second call
    assert calls_of(cut, LLAMA3) == ('{"name": "g", "param', [("f", {})])


def test_llama3_text_is_content():
    assert calls_of('Here: {"name": "f", "parameters": {}}', LLAMA3) == ('Here: {"name": "f", "parameters": {}}', [])
    assert calls_of('{"city": "Paris"}', LLAMA3) == ('{"city": "Paris"}', [])
    assert calls_of('{"name": "f", "parameters": {}} and more', LLAMA3)[1] == []
    assert calls_of("\n\nHello", LLAMA3) == ("Hello", [])


# -- parsing, streamed ------------------------------------------------------------------

_CALL = st.builds(lambda n, a: {"name": n, "arguments": a}, st.sampled_from(["f", "get_weather", "g_2"]),
                  st.dictionaries(st.sampled_from(["a", "city", "<"]), st.integers(-5, 5) | st.text(max_size=4),
                                  max_size=2))
_WORDS = st.sampled_from(["Hi", " ", "\n", "a < b", "<", "<tool", "tool_call>", "</tool_call>", "{", "}", "ok.",
                          '{"name": "f"}', "<|python_tag|>", ";"])


def _hermes_piece():
    return st.one_of(_WORDS, _CALL.map(lambda c: f"<tool_call>\n{json.dumps(c)}\n</tool_call>"),
                     _CALL.map(lambda c: f"<tool_call>{json.dumps(c)[:-1]}</tool_call>"))


def _llama_piece():
    return st.one_of(_WORDS, _CALL.map(lambda c: json.dumps({"name": c["name"], "parameters": c["arguments"]})))


def _split(data, text):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
@given(data=st.data())
def test_any_split_gives_the_same_content_and_calls(fmt, data):
    pieces = data.draw(st.lists(_hermes_piece() if fmt == HERMES else _llama_piece(), max_size=6))
    sep = "" if fmt == HERMES else data.draw(st.sampled_from(["", "; ", "\n"]))
    text = sep.join(pieces)
    parser, parts = StreamParser(fmt), []
    for delta in _split(data, text):
        parts += parser.feed(delta)
    parts += parser.finish()
    content = "".join(p for p in parts if isinstance(p, str)) or None
    calls = [(c.name, c.arguments) for c in parts if isinstance(c, tools.ToolCall)]
    whole_content, whole_calls = parse(text, fmt)
    assert (content, calls) == (whole_content, [(c.name, c.arguments) for c in whole_calls])
    assert parser.calls == len(calls)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
@given(data=st.data())
def test_a_repeated_call_is_seen_as_its_text_completes_in_any_split(fmt, data):
    """A forced reply (calls only, as the grammar writes them): RepeatWatch says True on the delta that
    completes the first call repeating an earlier one exactly, never before, whatever the split."""
    calls = data.draw(st.lists(_CALL, min_size=1, max_size=5))
    if fmt == HERMES:
        texts = [f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls]
        sep = "\n"
    else:
        texts = [json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls]
        sep = "; "
    text = sep.join(texts)
    whole = parse(text, fmt)[1]
    k = tools.first_repeat(whole)
    assert k == next((i for i, c in enumerate(calls) if c in calls[:i]), None)
    end = len(sep.join(texts[:k + 1])) if k is not None else None  # where the repeat's text completes
    watch, at = tools.RepeatWatch(fmt), 0
    for delta in _split(data, text):
        at += len(delta)
        seen = watch.feed(delta)
        assert seen == (end is not None and at >= end and at - len(delta) < end), (text, at, end)
        if seen:
            break


def test_streamed_content_is_not_held_longer_than_needed():
    p = StreamParser(HERMES)
    assert p.feed("Hello") == ["Hello"]
    assert p.feed(" <tool") == []  # may open a call
    assert p.feed("box> and") == [" <toolbox> and"]
    p = StreamParser(LLAMA3)
    assert p.feed("  ") == [] and p.feed("<|py") == []
    assert p.feed("thon_tag|>{") == []
    assert [c.name for c in p.feed('"name": "f"}') + p.finish()] == ["f"]


# -- the prompt --------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]


@pytest.mark.parametrize("family,fmt,native", [("qwen2", HERMES, True), ("qwen3", HERMES, True),
                                               ("llama", LLAMA3, True), ("gemma3", HERMES, False)])
def test_tools_reach_each_familys_template(models, family, fmt, native):
    model = models[family]
    assert tools.format_of(model) == fmt
    assert (tools.template_tools(model.tokenizer.chat_template) is not None) == native
    prompt = tools.render(model, CHAT, TOOLS)
    assert '"name": "get_weather"' in prompt and "The forecast of a city" in prompt
    assert "sunny, 21 C" in prompt and '"city": "Paris", "days": 1' in prompt
    assert ("<tool_call>" in prompt) == (fmt == HERMES)
    plain = tools.render(model, CHAT[:1], None)
    assert plain == model.chat_prompt(messages=CHAT[:1])  # no tools: the template's plain rendering
    assert "get_weather" not in plain


def test_a_rendered_call_parses_back(models):
    """The format a template shows the model is the format parsed: an earlier call, rendered, parses to itself."""
    model = models["qwen3"]
    before = tools.render(model, CHAT[:1], TOOLS)
    after = tools.render(model, [*CHAT[:2], {"role": "user", "content": "Thanks."}], TOOLS)
    assert after.startswith(before)
    turn = after[len(before):].split("<|im_end|>")[0]
    assert calls_of(turn, HERMES) == (None, [("get_weather", {"city": "Paris", "days": 1})])


def test_smollm2_gets_the_fallback(smollm2):
    """SmolLM2's template renders no tools: they come as a system message in the <tool_call> format, and the
    conversation's tool turns as text its template can render."""
    assert tools.template_tools(smollm2.tokenizer.chat_template) is None
    prompt = tools.render(smollm2, [{"role": "system", "content": "Be brief."}, *CHAT], TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' \
           '\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# -- the grammar that forces a call ------------------------------------------------------

def _walk(model, grammar: str, rng: random.Random, most: int = 400) -> str:
    """A random-weight model's worst case: any token the grammar allows, drawn at random, until it ends."""
    tok = model.tokenizer
    eos = sorted(model.eos_ids)
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=eos)
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    mask, out = allocate_token_bitmask(1, lltok.vocab_size), []
    for _ in range(most):
        if matcher.is_stopped():
            break
        fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:lltok.vocab_size])
        ends = [t for t in allowed if t in eos]
        t = int(ends[0] if ends and rng.random() < 0.3 else rng.choice(allowed))
        assert matcher.consume_token(t), matcher.get_error()
        if t in eos:
            break
        out.append(t)
    assert matcher.is_accepting()
    return tok.decode(out)


@pytest.mark.parametrize("family,fmt", [("qwen3", HERMES), ("llama", LLAMA3), ("smollm2", HERMES)])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_forced_call_always_parses_and_follows_its_schema(request, family, fmt, choice):
    model = request.getfixturevalue("smollm2") if family == "smollm2" else request.getfixturevalue("models")[family]
    rng = random.Random(f"{family}{choice}")
    name = None if choice == "required" else choice
    grammar = tools.forced_grammar(TOOLS, fmt, name=name, parallel=name is None)
    for _ in range(8):
        text = _walk(model, grammar, rng)
        content, calls = parse(text, fmt)
        assert content is None and calls, text
        for call in calls:
            assert call.name == (name or call.name) and call.name in SCHEMAS
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("params", [{"type": ["object", "null"], "properties": {"a": {"enum": [1, 2]}},
                                     "additionalProperties": False},
                                    {"properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
                                     "additionalProperties": False}])
def test_a_forced_calls_arguments_are_an_object_whatever_the_schema_also_allows(models, params):
    fn = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    grammar = tools.forced_grammar(fn, HERMES)
    rng = random.Random(3)
    for _ in range(6):
        text = _walk(models["qwen3"], grammar, rng)
        content, calls = parse(text, HERMES)
        assert content is None and calls, text
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)


def test_a_function_without_parameters_takes_any_object(models):
    grammar = tools.forced_grammar([{"type": "function", "function": {"name": "ping"}}], HERMES, parallel=False)
    failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.grammar_from("lark", grammar))
    assert not failed and not warnings
    assert "start: call\n" in grammar  # one call, not a sequence
