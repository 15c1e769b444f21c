"""Request parameters: one table checks them at every entry point, a refused value is an
InvalidRequestError naming its parameter, and no value that passes can harm another request."""

import asyncio
import math
import queue
import threading

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import slotinfer
from slotinfer import request
from slotinfer.errors import InvalidRequestError, PromptTooLongError
from slotinfer.sampling import SamplingParams
from test_cli import _cli
from test_serve_cli import folder, model  # noqa: F401 - the qwen3 folder and its model, as fixtures

GOOD = dict(max_tokens=12, ignore_eos=True)  # the greedy request running beside a bad one


@pytest.fixture(scope="module")
def solo(model):
    return model.generate("A good request", **GOOD).tokens


@pytest.fixture(scope="module")
def inf(model):
    with slotinfer.Inferencer(model, slots=4, max_len=64) as inf:
        yield inf


def _beside_a_good_request(inf, solo, submit_bad):
    """Run ``submit_bad()`` while a greedy request is decoding; that request's tokens must equal its solo run."""
    good = inf.submit("A good request", **GOOD)
    next(iter(good))  # it is running
    try:
        return submit_bad()
    finally:
        assert good.result(timeout=60).tokens == solo


@pytest.mark.parametrize("top_k", [2**31, 10**20, np.int64(2**40)])
def test_top_k_past_the_vocabulary_is_refused_at_submit(model, inf, solo, top_k):
    with pytest.raises(InvalidRequestError, match=f"top_k must be an int in \\[0, {model.config.vocab_size}\\]"):
        _beside_a_good_request(inf, solo, lambda: inf.submit("hi", max_tokens=4, temperature=1.0, top_k=top_k))


def test_top_k_up_to_the_vocabulary_runs(model, inf):
    vocab = model.config.vocab_size
    for k in (vocab - 1, vocab):
        kw = dict(max_tokens=4, temperature=1.0, top_k=k, seed=3, ignore_eos=True)
        assert inf.generate("hi", **kw).tokens == model.generate("hi", **kw).tokens


def _closed_loop():
    loop = asyncio.new_event_loop()
    loop.close()
    return loop


@pytest.mark.parametrize("loop", [object(), "loop", 3, _closed_loop()])
def test_loop_must_be_an_open_event_loop(inf, solo, loop):
    with pytest.raises(InvalidRequestError, match="loop must be an open asyncio event loop"):
        _beside_a_good_request(inf, solo, lambda: inf.submit("hi", max_tokens=4, loop=loop))


def test_an_unknown_keyword_is_named_with_its_close_match(model, inf):
    with pytest.raises(InvalidRequestError) as e:
        inf.submit([1, 2, 3], max_new_tokens=3)
    msg = str(e.value)
    assert "'max_new_tokens'" in msg and "did you mean 'max_tokens'" in msg and "make_item" not in msg
    assert all(name in msg for name in request.SUBMIT) and e.value.param == "max_new_tokens"
    with pytest.raises(InvalidRequestError, match="unknown Model.generate parameter 'logprobs'"):
        model.generate("hi", logprobs=True)
    [r] = model.batch_generate(["hi"], max_tokenz=3)
    assert isinstance(r.error, InvalidRequestError) and "did you mean 'max_tokens'" in str(r.error)


@pytest.mark.parametrize("bad, name", [
    (dict(stop_token_ids="abc"), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"), (dict(max_tokens=10**18), "max_tokens"),
    (dict(max_tokens=3.0), "max_tokens"), (dict(top_k=2**31), "top_k"), (dict(temperature=math.nan), "temperature"),
    (dict(top_p=math.inf), "top_p"), (dict(min_p=True), "min_p"),
    (dict(repetition_penalty=10**400), "repetition_penalty"),
    (dict(seed=2**32), "seed"), (dict(seed=np.float64(1)), "seed"), (dict(stop=[""]), "stop"),
    (dict(stop=["x"] * 1000), "stop"), (dict(stop=b"x"), "stop"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(skip_special_tokens=1), "skip_special_tokens"),
])
def test_every_entry_point_refuses_what_submit_refuses(model, inf, bad, name):
    with pytest.raises(InvalidRequestError, match=name):
        model.generate("hi", **bad)
    with pytest.raises(InvalidRequestError, match=name):
        inf.submit("hi", **bad)
    [r] = model.batch_generate(["hi"], **bad)
    assert isinstance(r.error, InvalidRequestError) and name in str(r.error)
    if bad != dict(stop_token_ids=[10**9]):  # within bounds until a vocabulary is known
        with pytest.raises(InvalidRequestError, match=name):
            request.check(bad)  # the model-free check of the CLI and the Ray jobs


@pytest.mark.parametrize("name, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", True), ("temperature", -1.0),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.0), ("min_p", np.bool_(False)), ("repetition_penalty", 0),
    ("top_k", -1), ("top_k", 1.0), ("top_k", np.bool_(True)), ("seed", -1), ("seed", True),
])
def test_sampling_params_keep_the_tables_rules(name, value):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**{name: value})


def test_numpy_scalars_are_taken_as_python_numbers(model, inf):
    np_kw = dict(max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(40), top_p=np.float64(0.9),
                 min_p=np.float16(0.01), repetition_penalty=np.float32(1.2), seed=np.uint32(7),
                 ignore_eos=np.bool_(True), stop_token_ids=np.array([3, 4]))
    py_kw = dict(max_tokens=5, temperature=float(np.float32(0.5)), top_k=40, top_p=0.9,
                 min_p=float(np.float16(0.01)), repetition_penalty=float(np.float32(1.2)), seed=7, ignore_eos=True,
                 stop_token_ids=[3, 4])
    want = model.generate("numbers", **py_kw).tokens
    assert model.generate("numbers", **np_kw).tokens == want
    assert inf.generate("numbers", **np_kw, logprobs=np.bool_(True), top_logprobs=np.int8(2)).tokens == want
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(1))
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.seed) is int


def test_a_parameters_own_error_comes_before_the_prompts(model, inf):
    too_long = list(range(1, 60)) * 40  # longer than the model's context
    with pytest.raises(InvalidRequestError, match="temperature") as e:
        inf.submit(too_long, temperature=-1)
    assert not isinstance(e.value, PromptTooLongError)
    with pytest.raises(InvalidRequestError, match="temperature") as e:
        model.generate(too_long, temperature=-1)
    assert not isinstance(e.value, PromptTooLongError)
    [r] = model.batch_generate([too_long], temperature=-1)
    assert "temperature" in str(r.error) and not isinstance(r.error, PromptTooLongError)
    with pytest.raises(InvalidRequestError, match="timeout"):
        inf.submit(messages=None, timeout="soon")


def test_classify_bounds_top_k_by_the_vocabulary(model):
    with pytest.raises(InvalidRequestError, match="top_k"):
        model.classify(["hi"], top_k=10**20)
    with pytest.raises(InvalidRequestError, match="temperature"):
        model.classify(["hi"], temperature=math.nan)


@pytest.mark.parametrize("flag, value", [("--top-k", "3000000000"), ("--max-tokens", "99999999999"),
                                         ("--temperature", "nan"), ("--top-p", "inf"), ("--seed", "4294967296"),
                                         ("--logprobs", "-1")])
def test_cli_flags_are_checked_by_the_same_table(folder, capsys, flag, value):
    rc, out, err = _cli(["generate", "--model", folder, flag, value, "hello"], capsys)
    assert rc == 2 and out == "" and f"argument {flag}:" in err


def test_http_schema_refuses_by_the_same_table():
    from slotinfer.serve.errors import APIError
    from slotinfer.serve.schemas import parse_chat, parse_completion

    for name, value in [("top_k", 2**31), ("temperature", math.nan), ("seed", 2**32), ("stop_token_ids", "abc"),
                        ("stop_token_ids", [-1]), ("skip_special_tokens", 1)]:
        with pytest.raises(APIError) as e:
            parse_completion({"prompt": "hi", name: value})
        assert e.value.param == name and name in str(e.value)
    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**18})
    assert e.value.param == "max_completion_tokens"
    req = parse_completion({"prompt": "hi", "stop": "x", "top_k": 5, "stop_token_ids": [1]})
    assert req.params["stop"] == ["x"] and req.params["top_k"] == 5


def test_serve_queue_answers_malformed_items_with_short_typed_errors(model, inf):
    items = [{"id": "int keys", "prompt": "x", 1: 2, 2.5: 3}, {"id": "unknown", "prompt": "x", "max_new_tokens": 2},
             {"id": "huge", "prompt": "x", **{f"k{i}": i for i in range(100_000)}},
             {"id": "no prompt", **{f"k{i}": i for i in range(100_000)}},
             slotinfer.Request("x", None, id="params None"), slotinfer.Request("x", [("max_tokens", 2)], id="list"),
             {"id": "good", "prompt": "x", "max_tokens": 2}]
    in_q, out_q = queue.Queue(), queue.Queue()
    for it in items:
        in_q.put(it)
    in_q.put(None)
    t = threading.Thread(target=inf.serve_queue, args=(in_q, out_q), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive()
    out = {c.request_id: c for c in iter(out_q.get_nowait, None)}
    assert out["good"].finish_reason == "length"
    for rid in ("int keys", "unknown", "huge", "no prompt", "params None", "list"):
        err = out[rid].error
        assert type(err) is InvalidRequestError and len(str(err)) < 600, (rid, err)
    assert "names must be strings, got 1, 2.5" in str(out["int keys"].error)
    assert "did you mean 'max_tokens'" in str(out["unknown"].error)
    assert "and 99997 more" in str(out["huge"].error) and "and 99998 more" in str(out["no prompt"].error)
    assert "Request.params must be a dict" in str(out["params None"].error)


# -- the property: whatever a caller passes, submit refuses it by name or runs it, and harms no one --------

_NAMES = [p.name for p in request.TABLE if p.name != "on_token"]
_VALID = {
    "max_tokens": st.integers(1, 6), "temperature": st.sampled_from([0.0, 0.5, 1.0, 1e6, np.float32(0.7)]),
    "top_k": st.sampled_from([0, 1, 5, 576, np.int64(3)]), "top_p": st.sampled_from([1e-6, 0.5, 1.0]),
    "min_p": st.sampled_from([0.0, 0.05, 0.999999]), "repetition_penalty": st.sampled_from([1e-6, 0.5, 1.3, 1e6]),
    "seed": st.one_of(st.none(), st.integers(0, 2**32 - 1)), "stop": st.sampled_from([None, "a", ["the", "e"]]),
    "stop_token_ids": st.sampled_from([(), [1], np.array([2, 3])]), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.sampled_from([True, False, np.bool_(False)]), "logprobs": st.booleans(),
    "top_logprobs": st.sampled_from([0, 1, 576]), "loop": st.none(), "block": st.booleans(),
    "timeout": st.sampled_from([None, 0.0, 5]), "presence_penalty": st.sampled_from([-2.0, 0.0, 1.5]),
    "frequency_penalty": st.sampled_from([-0.5, 0.0, 2]), "logit_bias": st.sampled_from([None, {}, {"5": -100},
                                                                                        {7: 2.5, 575: 100}]),
    "json_schema": st.sampled_from([None, {"type": "object"}, '{"enum": [1, "a"]}']),
    "regex": st.sampled_from([None, "[a-z]{1,3}", "x*"]), "choice": st.sampled_from([None, ("a", "b c")]),
    "grammar": st.sampled_from([None, 'start: "x" | "yz"']),
}
_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=5),
    st.binary(max_size=3), st.lists(st.integers(-3, 10**6), max_size=3), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from([np.int64(-1), np.int64(2**62), np.uint64(2**63), np.float32("nan"), np.float64(-0.0),
                     np.bool_(True), np.float16(65504), np.array(3), np.array([1.5]), object(), print, _closed_loop()]),
)
_PARAMS = st.dictionaries(
    st.one_of(st.sampled_from(_NAMES), st.sampled_from(["max_new_tokens", "topk", "n", "best_of", "X"])),
    _ANY, max_size=3,
).flatmap(lambda bad: st.fixed_dictionaries({}, optional=_VALID).map(lambda ok: {**ok, **bad}))


@given(params=_PARAMS)
def test_any_parameters_are_refused_by_name_or_run_and_harm_no_other_request(inf, solo, params):
    params = {"max_tokens": 4, **params}

    def submit():
        try:
            return inf.submit("Any request", **params)
        except InvalidRequestError as e:
            return e

    got = _beside_a_good_request(inf, solo, submit)
    event("refused" if isinstance(got, InvalidRequestError) else "ran")
    if isinstance(got, InvalidRequestError):
        name = "max_tokens" if isinstance(got, PromptTooLongError) else got.param
        assert name in params and name in str(got) and len(str(got)) < 1000, (params, got)
    else:
        c = got.result(timeout=60)
        assert c.finish_reason in ("length", "stop") and 1 <= len(c.tokens) <= params["max_tokens"]


@pytest.mark.parametrize("key", [" 5", "5 ", "+5", "-0", "05", "\uff15", "\u0665", "5_0", "5.0", "0x5", True, 5.0])
def test_logit_bias_keys_are_token_ids_or_their_canonical_decimal_text(key):
    """A key is an int or its canonical decimal text ("5"); anything int() would also read (" 5", "+5",
    "05", full-width or Arabic-Indic digits) is refused by name, in the library and over HTTP alike."""
    from slotinfer.serve.errors import APIError
    from slotinfer.serve.schemas import parse_completion

    with pytest.raises(InvalidRequestError, match="logit_bias"):
        request.check({"logit_bias": {key: 1.0}})
    if isinstance(key, str):
        with pytest.raises(APIError) as e:
            parse_completion({"prompt": "hi", "logit_bias": {key: 1.0}})
        assert e.value.param == "logit_bias" and "logit_bias" in str(e.value)
    assert request.check({"logit_bias": {"5": 1.0, 0: -2, np.int64(7): 3}})["logit_bias"] == {5: 1.0, 0: -2.0, 7: 3.0}
    assert parse_completion({"prompt": "hi", "logit_bias": {"5": 1, "0": 2}}).params["logit_bias"] == {5: 1.0, 0: 2.0}
