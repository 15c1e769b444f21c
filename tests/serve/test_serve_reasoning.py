"""Reasoning split out of replies: ``<think>`` blocks of a thinking template's model become chat's
``reasoning_content``, Responses' reasoning items and Anthropic's thinking blocks, whole and streamed
(kept apart from the answer), any split of a reply giving the same parts; later turns still hit the
prefix cache."""

import json
import re
import shutil
from types import SimpleNamespace

import anthropic
import openai
import pytest
from hypothesis import given, strategies as st
from pydantic import TypeAdapter

import slotinfer
from slotinfer.text.reasoning import INSIDE, MAYBE, ReasoningSplitter, mode, split
from slotinfer.serve import anthropic as messages_api, openai_responses
from slotinfer.serve.background import serving
from slotinfer.serve import build_app

NAME = "tiny"
MSGS = [{"role": "user", "content": "Name a colour."}]
WORD = "[a-z]{2,6}( [a-z]{2,6}){1,3}"
# Qwen 3's test template with the generation prompt opening the block, as Qwen3-*-Thinking templates do
_IF_OFF = "{%- if enable_thinking is defined and enable_thinking is false -%}\n"
OPENS = (f"{{{{- '<|im_start|>assistant\\n' -}}}}\n{_IF_OFF}{{{{- '<think>\\n\\n</think>\\n\\n' -}}}}",
         f"{{{{- '<|im_start|>assistant\\n<think>\\n' -}}}}\n{_IF_OFF}{{{{- '\\n</think>\\n\\n' -}}}}")


@pytest.fixture(scope="module")
def model(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking") / "qwen3-thinking"
    shutil.copytree(model_dir("qwen3"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert OPENS[0] in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(*OPENS)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return slotinfer.load(path)


@pytest.fixture(scope="module")
def THOUGHT(model):
    """A request's constraint to a reasoning block closed by the ``</think>`` token, then an answer."""
    [close] = model.tokenizer.encode("</think>", add_special_tokens=False)
    return {"structured_outputs": {"grammar": f"start: /{WORD}\\n/ <[{close}]> /\\n\\n{WORD}/\n"}, "temperature": 0}


@pytest.fixture(scope="module")
def server(model):
    with slotinfer.Inferencer(model, slots=4, max_len=1024, max_queue=16) as inf:
        with serving(build_app(inf, served_model_name=NAME)) as url:
            yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="-", max_retries=0, timeout=120)


def _raw(model, messages, **kw):
    """The model's own reply to ``messages`` (reasoning and answer in one text)."""
    return model.generate(model.apply_chat_template(messages, **kw.pop("template", {})), **kw).text


def test_chat_splits_reasoning_content_from_the_answer_whole_and_streamed(oai, model, THOUGHT):
    raw = _raw(model, MSGS, max_tokens=60, grammar=THOUGHT["structured_outputs"]["grammar"])
    thought, answer = raw.split("\n</think>\n\n")
    r = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=60, extra_body=THOUGHT)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == (thought, answer)
    chunks = list(oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=60, extra_body=THOUGHT,
                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) for d in deltas]
    assert "".join(x for x in reasoning if x) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)  # kept apart
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_answer:])


def test_a_regex_with_the_close_tag_sees_the_token_as_its_text(oai, model):
    """A regex (not a token-level grammar) that writes ``</think>``: the model's ``</think>`` token is
    that text to the constraint, so the reply satisfies it and splits at it, whole and streamed."""
    regex = f"{WORD}\n</think>\n\n{WORD}"
    [close] = model.tokenizer.encode("</think>", add_special_tokens=False)
    out = model.generate(model.apply_chat_template(MSGS), max_tokens=60, regex=regex)
    assert close in out.tokens and re.fullmatch(regex, out.text) and out.finish_reason == "stop"
    thought, answer = out.text.split("\n</think>\n\n")
    body = {"structured_outputs": {"regex": regex}}
    r = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=60, temperature=0, extra_body=body)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == (thought, answer, "stop")
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(
        model=NAME, messages=MSGS, max_tokens=60, temperature=0, extra_body=body, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    # a special token's text in a regex is text: spelled out, never the (end) token itself
    text = model.generate("Hello", max_tokens=20, regex="ab<\\|im_end\\|>").text
    assert text == "ab<|im_end|>"


def test_enable_thinking_false_leaves_the_reply_all_answer(oai, model):
    raw = _raw(model, MSGS, max_tokens=8, template={"enable_thinking": False})
    r = oai.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == raw and getattr(r.choices[0].message, "reasoning_content", None) is None


def test_a_response_has_a_reasoning_item_whole_and_streamed(oai, model):
    raw = _raw(model, MSGS, max_tokens=10)  # random weights never close the block: all reasoning
    r = oai.responses.create(model=NAME, input=MSGS, max_output_tokens=10, temperature=0)
    [item] = r.output
    assert item.type == "reasoning" and item.content[0].text == raw.strip() and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oai.responses.create(model=NAME, input=MSGS, max_output_tokens=10, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == raw.strip()
    assert not [e for e in events if e.type == "response.output_text.delta"]
    assert events[-1].response.output[0].content[0].text == raw.strip()


def test_a_message_has_a_thinking_block_whole_and_streamed(claude, model):
    raw = _raw(model, MSGS, max_tokens=10)
    m = claude.messages.create(model=NAME, max_tokens=10, messages=MSGS, extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == raw.strip()
    with claude.messages.stream(model=NAME, max_tokens=10, messages=MSGS, extra_body={"temperature": 0}) as s:
        kinds = {e.delta.type for e in s if e.type == "content_block_delta"}
        final = s.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" not in kinds
    assert final.content[0].thinking == raw.strip() and final.stop_reason == "max_tokens"


def test_the_next_turn_still_hits_the_prefix_cache(oai, model, THOUGHT):
    """The template drops the earlier answer's reasoning: the next turn reuses the conversation up to
    that answer (every full block of the first turn's prompt), not the answer's own tokens."""
    system = {"role": "system", "content": "You answer after thinking it over, briefly. " * 5}
    turn = [system, *MSGS]
    first = oai.chat.completions.create(model=NAME, messages=turn, max_tokens=60, extra_body=THOUGHT)
    msg = first.choices[0].message
    again = [*turn, {"role": "assistant", "content": msg.content, "reasoning_content": msg.reasoning_content},
             {"role": "user", "content": "And another?"}]
    second = oai.chat.completions.create(model=NAME, messages=again, max_tokens=4, temperature=0)
    hit, n = second.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens
    assert hit >= n // 32 * 32 and hit < n + first.usage.completion_tokens, (hit, n)
    rendered = model.apply_chat_template(again)
    assert msg.reasoning_content not in rendered and msg.content in rendered  # what the template drops


# -- the splitter and the shapers, on any split of a reply ---------------------------------

_text = st.text(st.sampled_from("ab <>/\nthink"), max_size=30)


def _cuts(text, points):
    points = sorted({p % (len(text) + 1) for p in points})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@given(_text, _text, st.sampled_from([INSIDE, MAYBE, None]), st.lists(st.integers(0, 200), max_size=8))
def test_any_split_of_a_reply_gives_the_same_reasoning_and_answer(thought, answer, start, points):
    text = ("<think>" if start == MAYBE else "") + thought + "</think>" + answer
    s = ReasoningSplitter(start)
    parts = [s.feed(piece) for piece in _cuts(text, points)] + [s.finish()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == split(text, start)
    if start is None:
        assert split(text, start) == ("", text)
    elif "<think>" not in thought and "</think>" not in thought and "think>" not in answer[:1]:
        assert split(text, start)[0] == thought.strip()


def test_mode_follows_the_template_and_the_prompt():
    assert mode(None, "x") is None and mode("{{ messages }}", "<think>") is None
    assert mode("..</think>..", "<|im_start|>assistant\n<think>\n") == INSIDE
    assert mode("..</think>..", "<|im_start|>assistant\n<think>\n\n</think>\n\n") == MAYBE
    assert mode("..</think>..", "<|im_start|>assistant\n") == MAYBE


_REPLY = '<think>\nplan it\n</think>\n\nSure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@given(st.lists(st.integers(0, 200), max_size=12))
def test_streamed_events_are_the_sdks_types_and_add_up_to_the_whole(points):
    from anthropic.types import RawMessageStreamEvent
    from openai.types.responses import ResponseStreamEvent

    tool = {"name": "f", "parameters": {"type": "object"}}
    req = openai_responses.parse({"input": "hi", "tools": [{"type": "function", **tool}]})
    req2 = messages_api.parse({"messages": MSGS, "max_tokens": 9, "tools": [{"name": "f", "input_schema": {}}]})
    req.reasoning = req2.reasoning = MAYBE
    done = SimpleNamespace(text=_REPLY, tokens=[1, 2], finish_reason="stop")
    used = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0}}
    for shaper, adapter in ((openai_responses.Shaper(req, NAME, "hermes", len), TypeAdapter(ResponseStreamEvent)),
                            (messages_api.Shaper(req2, NAME, "hermes", 5, lambda ids: _REPLY),
                             TypeAdapter(RawMessageStreamEvent))):
        lines = shaper.opening(1)
        for piece in _cuts(_REPLY, points):
            lines += shaper.text_chunks(0, piece)
        lines += shaper.end_chunks(0, "stop") + shaper.closing(used, [done])
        events = [adapter.validate_python(json.loads(x.split("data: ", 1)[1])) for x in lines
                  if not x.startswith("event: ping")]  # a ping may come any time; the SDK skips it
        whole = shaper.completion([(0, done, False)], used)
        if isinstance(shaper, openai_responses.Shaper):
            final = events[-1].response
            assert [i.type for i in final.output] == [i["type"] for i in whole["output"]] == [
                "reasoning", "message", "function_call"]
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure."
            assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == ['{"x": 1}']
        else:
            assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
            assert whole["stop_reason"] == events[-2].delta.stop_reason == "tool_use"
            starts = [e.content_block.type for e in events if e.type == "content_block_start"]
            assert starts == ["thinking", "text", "tool_use"]
            assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                           and e.delta.type == "thinking_delta") == "plan it"
