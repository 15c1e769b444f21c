"""Hostile constraints: whatever shape a client sends, it ends served or refused with a typed error
naming its field, and the process lives.

Chains, nests and alternations up to the request size limit (``request.MAX_GRAMMAR``) for every
constraint field, compiled in a child process so that a regression (a native stack overflow in
llguidance) fails the test instead of killing pytest; compiles past the time bound are stopped and
never fail another request's small schema; matchers that fail mid-output end their request with
an error, never "stop".
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotinfer
from slotinfer import GrammarBusy, GrammarError, InvalidRequestError, request
from slotinfer.engine import grammar_compile

LIMIT = request.MAX_GRAMMAR


def lark_chain(n):
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "a"\n'


def ref_chain(n):
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nest_schema(n):
    s = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"], "additionalProperties": False}
    return s


SHAPES = {  # (field, shape) -> a constraint of about n links
    ("grammar", "chain"): lark_chain,
    ("grammar", "nest"): lambda n: "start: " + "(" * n + '"a"' + ")" * n,
    ("grammar", "alternation"): lambda n: "start: " + " | ".join(f'"a{i}"' for i in range(n)),
    ("json_schema", "chain"): ref_chain,
    ("json_schema", "nest"): nest_schema,
    ("json_schema", "alternation"): lambda n: {"anyOf": [{"const": f"v{i}"} for i in range(n)]},
    ("regex", "chain"): lambda n: "a" * n,
    ("regex", "nest"): lambda n: "(" * n + "a" + ")" * n,
    ("regex", "alternation"): lambda n: "|".join(f"a{i}" for i in range(n)),
    ("choice", "alternation"): lambda n: [f"c{i}" for i in range(min(n, request.MAX_CHOICES))],
}
MOST = {"chain": 60_000, "nest": 200_000, "alternation": 150_000}  # past each, the text outgrows the limit

# Run in a child: each constraint through Model.generate; prints one outcome a line.
_CHILD = """
import json, sys, slotinfer
from slotinfer import InvalidRequestError
sys.path.insert(0, sys.argv[2])
from test_constraint_limits import MOST, SHAPES
m = slotinfer.load(sys.argv[1])
for line in sys.stdin:
    case = json.loads(line)
    if case[0] == "shape":  # built here: a dict nested past what JSON text carries
        _, field, kind, n = case
        value = SHAPES[field, kind](min(n, MOST[kind]))
    else:
        _, field, value = case
    try:
        r = m.generate([5, 6], max_tokens=3, **{field: value})
        print(json.dumps(["served", r.finish_reason]), flush=True)
    except InvalidRequestError as e:
        print(json.dumps([type(e).__name__, e.param]), flush=True)
"""


def run_child(model_path, cases, timeout=240):
    """Outcomes of ``cases`` [(field, value)] or [("shape", field, kind, n)] in a fresh process, which
    must exit normally."""
    stdin = "".join(json.dumps(c if c[0] == "shape" else ["value", *c]) + "\n" for c in cases)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model_path), os.path.dirname(__file__)], input=stdin,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"the process died (status {proc.returncode}): {proc.stderr[-800:]}"
    return [json.loads(line) for line in proc.stdout.splitlines()]


shape = st.tuples(st.sampled_from(sorted(SHAPES)),
                  st.one_of(st.integers(1, 3000), st.sampled_from([2500, 3000, 10_000]),
                            st.integers(3000, 200_000)))


@settings(max_examples=max(2, settings().max_examples // 4))
@given(st.lists(shape, min_size=1, max_size=4))
def test_every_shape_is_served_or_refused_by_name(model_dir, cases):
    sent = [("shape", field, kind, n) for (field, kind), n in cases]
    outcomes = run_child(model_dir("llama"), sent)
    assert len(outcomes) == len(sent)
    for (_, field, _, _), (what, detail) in zip(sent, outcomes):
        assert what == "served" or (what in ("GrammarError", "InvalidRequestError") and detail == field), \
            (field, what, detail)


@pytest.mark.slow  # the CLI as a subprocess
def test_the_chains_that_crashed_the_compiler(model_dir, tmp_path):
    """3,000 chained Lark rules and 2,500 chained $refs overflowed the native stack (SIGSEGV)."""
    outcomes = run_child(model_dir("llama"), [("grammar", lark_chain(3000)), ("json_schema", ref_chain(2500))])
    assert outcomes == [["served", "length"], ["served", "stop"]]
    schema = tmp_path / "chain.json"
    schema.write_text(json.dumps(ref_chain(2500)))
    cli = subprocess.run([sys.executable, "-m", "slotinfer", "generate", "--model", str(model_dir("llama")),
                          "--json-schema", str(schema), "--max-tokens", "4", "hi"],
                         capture_output=True, text=True, timeout=240)
    assert cli.returncode == 0, cli.stderr[-800:]


def test_a_forced_tool_call_with_chained_parameters(model_dir):
    """The grammar that forces a call to a function whose parameters chain 2,500 $refs."""
    from slotinfer import tools

    chain = ref_chain(2500)
    fn = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": chain["$ref"]}}, "required": ["x"], "$defs": chain["$defs"]}}}]
    grammar = tools.forced_grammar(fn, "hermes", name=None, parallel=False)
    [(what, param)] = run_child(model_dir("qwen3"), [("grammar", grammar)])
    assert what == "served" or (what == "GrammarError" and param == "grammar")


def test_a_compile_that_overflows_its_stack_is_a_grammar_error(models, monkeypatch):
    """The child that vets a constraint dies of a stack overflow (here on a 1 MiB stack; the limits
    admit no chain that outgrows the real one); the request is refused and the next one served."""
    from slotinfer.engine import structured

    monkeypatch.setattr(grammar_compile, "STACK_BYTES", 1 << 20)
    monkeypatch.setattr(structured, "COMPILER", grammar_compile.Compiler())
    m = models["gemma2"]
    with pytest.raises(GrammarError, match="nested too deeply") as e:
        m.generate([5], grammar=lark_chain(3000), max_tokens=2)
    assert e.value.param == "grammar"
    assert m.generate([5], regex="[ab]{3}", max_tokens=3).finish_reason in ("stop", "length")
    structured.COMPILER.close()


def _slow(i):  # ~10,000 optional properties: many seconds to compile
    return {"type": "object", "properties": {f"p{i}_{k}": {"type": "string"} for k in range(10_000)}}


def test_compiles_past_the_bound_stop_and_never_fail_a_small_schema(models, monkeypatch):
    monkeypatch.setenv("SLOTINFER_GRAMMAR_SECONDS", "1.5")
    m = models["qwen3"]
    m.generate([5], json_schema={"type": "integer"}, max_tokens=2)  # warm: the compile children exist
    outcomes = {}

    def slow(i):
        try:
            m.generate([5], json_schema=_slow(i), max_tokens=2)
            outcomes[i] = "served"
        except GrammarError as e:
            outcomes[i] = str(e)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    small = m.generate([5], json_schema={"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"], "additionalProperties": False}, max_tokens=12)
    assert small.finish_reason in ("stop", "length")
    for t in threads:
        t.join()
    assert all("SLOTINFER_GRAMMAR_SECONDS" in o or o == "served" for o in outcomes.values()), outcomes
    time.sleep(1.0)  # the killed children are gone: what is left idles
    before = _children_cpu()
    time.sleep(0.5)
    after = _children_cpu()
    busy = [pid for pid in after if after[pid] - before.get(pid, 0) > 10]  # clock ticks: 0.1 s of 0.5
    assert not busy, f"{len(busy)} compile processes still burn CPU"


def _children_cpu() -> dict:
    """{pid: user + system clock ticks} of this process's children (Linux /proc)."""
    from pathlib import Path

    pids = {int(p) for f in Path("/proc/self/task").glob("*/children") for p in f.read_text().split()}
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = int(fields[11]) + int(fields[12])
    return out


def test_too_many_compiles_at_once_is_a_retryable_refusal(models, monkeypatch):
    monkeypatch.setenv("SLOTINFER_GRAMMAR_SECONDS", "3")
    monkeypatch.setattr(grammar_compile, "RUNNING", 1)
    monkeypatch.setattr(grammar_compile, "WAITING", 0)
    m = models["qwen3"]
    first = threading.Thread(target=lambda: pytest.raises(GrammarError, m.generate, [5], json_schema=_slow(9),
                                                          max_tokens=2))
    first.start()
    deadline = time.monotonic() + 60  # until the slow compile holds the one place (a loaded machine takes a while)
    while grammar_compile.COMPILER._running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(GrammarBusy, match="retry"):
        m.generate([5], json_schema={"type": "boolean"}, max_tokens=2)
    first.join()
    assert isinstance(GrammarBusy("x"), slotinfer.QueueFull)


@pytest.mark.parametrize("params, param", [
    (dict(regex="(ab){300000}"), "regex"),
    (dict(json_schema={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "json_schema"),
])
def test_a_failing_matcher_is_an_error_never_stop_and_never_cached(models, monkeypatch, params, param):
    monkeypatch.setenv("SLOTINFER_GRAMMAR_SECONDS", "60")
    m = models["llama"]
    for _ in range(3):  # the second and third find the compiled constraint cached
        try:
            out = m.generate([5, 6], max_tokens=40, **params)
        except InvalidRequestError as e:
            assert isinstance(e, GrammarError) and e.param == param and "<state>" not in str(e)
            continue
        assert out.finish_reason == "length", out  # a "stop" would be an output the constraint refuses


def test_a_stream_that_fails_mid_output_ends_with_the_error(models, monkeypatch):
    monkeypatch.setenv("SLOTINFER_GRAMMAR_SECONDS", "60")
    m = models["llama"]
    with slotinfer.Inferencer(m, slots=2, max_len=128) as inf:
        h = inf.submit([5, 6], max_tokens=100, regex="(ab){300000}")
        with pytest.raises(GrammarError) as e:
            h.result(timeout=60)
        assert e.value.param == "regex"
        assert inf.generate([5, 6], max_tokens=3).finish_reason == "length"  # the engine goes on


@pytest.mark.parametrize("params, param", [
    (dict(choice=["x" * 199 + f"{i:04d}"[-1] + f"{i:04d}" for i in range(request.MAX_CHOICES)]), "choice"),
    (dict(json_schema={"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(3000)}}),
     "json_schema"),
    (dict(grammar="start: " + " ".join(f"r{i}" for i in range(2000)) + "\n"
          + "".join(f'r{i}: "a{i}"?\n' for i in range(2000))), "grammar"),
])
def test_constraints_that_break_on_their_first_tokens_are_the_clients_error(models, monkeypatch, params, param):
    monkeypatch.setenv("SLOTINFER_GRAMMAR_SECONDS", "30")
    m = models["llama"]
    try:
        out = m.generate([5, 6], max_tokens=4, **params)
    except InvalidRequestError as e:
        assert e.param == param and "<state>" not in str(e), e
    else:
        assert out.finish_reason in ("stop", "length")


def test_unbounded_numbers_get_the_policy_bounds():
    from slotinfer.json_numbers import LIMIT as BOUND
    from slotinfer.json_numbers import bounded

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]},
                                               "low": {"type": "integer", "minimum": 3},
                                               "p": {"type": "number", "multipleOf": 0.5, "maximum": 9}},
              "$defs": {"d": {"type": "integer"}}, "items": [{"type": "number"}]}
    out = bounded(schema)
    assert out["properties"]["n"] == {"type": "integer", "minimum": -BOUND, "maximum": BOUND}
    assert out["properties"]["x"]["maximum"] == BOUND and out["properties"]["x"]["multipleOf"] == 1e-10
    assert out["properties"]["low"] == {"type": "integer", "minimum": 3, "maximum": BOUND}
    assert out["properties"]["p"] == {"type": "number", "multipleOf": 0.5, "maximum": 9, "minimum": -BOUND}
    assert out["$defs"]["d"]["minimum"] == -BOUND and out["items"][0]["maximum"] == BOUND
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's schema is untouched


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "number"}},
        "required": ["city", "population"], "additionalProperties": False}
TOWN = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"},
                                         "country": {"type": "string"}},
        "required": ["name", "population", "country"], "additionalProperties": False}


@pytest.mark.parametrize("schema, question", [(CITY, "Tell me about Paris."), (CITY, "Say something"),
                                              (TOWN, "Give me a city and its population.")])
def test_the_real_model_ends_its_numbers(smollm2, schema, question):
    """SmolLM2 greedy wrote a population's digits (or decimals) until max_tokens where numbers had no bound."""
    m = smollm2
    r = m.generate(m.chat_prompt(messages=[{"role": "user", "content": question}]), json_schema=schema,
                   max_tokens=100)
    assert r.finish_reason == "stop", r.text
    population = json.loads(r.text)["population"]
    assert abs(population) <= 2**53 and (type(population) is int or schema is CITY)


@pytest.mark.skipif(not os.environ.get("SLOTINFER_EXAMPLES"), reason="the long runs: set SLOTINFER_EXAMPLES")
def test_the_largest_chains_the_limit_admits(model_dir):
    """The longest Lark chain and $ref chain that fit request.MAX_GRAMMAR end served or refused."""
    n = LIMIT // len('r99999: "a" r99999\n')
    outcomes = run_child(model_dir("llama"), [("grammar", lark_chain(n)), ("json_schema", ref_chain(n // 2))],
                         timeout=600)
    assert outcomes[0] == ["GrammarError", "grammar"] and outcomes[1][0] == "served", outcomes  # 65,535 symbols


# -- through the server, run in a child process: a crash fails the test, not pytest ------------------

_SERVER = """
import sys, slotinfer
from slotinfer.serve import build_app
from slotinfer.serve.background import serving
m = slotinfer.load(sys.argv[1])
with slotinfer.Inferencer(m, slots=4, max_len=4096, max_queue=16) as inf:
    with serving(build_app(inf, served_model_name="tiny")) as url:
        print(url, flush=True)
        sys.stdin.read()
"""


@pytest.fixture(scope="module")
def client(model_dir):
    import openai

    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(model_dir("qwen3"))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    url = proc.stdout.readline().strip()
    assert url.startswith("http"), "the server did not start"
    yield openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=240), proc
    proc.stdin.close()
    proc.wait(timeout=60)


def _tool(schema):
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


MSG = [{"role": "user", "content": "hi"}]
OVER_HTTP = [  # (create() keywords, the field a refusal must name)
    (dict(extra_body={"structured_outputs": {"grammar": lark_chain(3000)}}), "structured_outputs"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": ref_chain(2500)}}),
     "response_format"),
    (dict(tools=_tool({"type": "object", "properties": {"x": ref_chain(2500)}, "required": ["x"]}),
          tool_choice="required"), ("tools", "messages")),  # the tools fill the prompt past a tiny context
    (dict(extra_body={"guided_regex": "(" * 3000 + "a" + ")" * 3000}), "guided_regex"),
    (dict(extra_body={"guided_regex": "(ab){300000}"}), "guided_regex"),
    (dict(extra_body={"guided_choice": [f"c{i}" for i in range(request.MAX_CHOICES)]}), "guided_choice"),
]


@pytest.mark.parametrize("kw, field", OVER_HTTP)
def test_over_http_every_constraint_is_served_or_a_400_naming_its_field(client, kw, field):
    import openai

    api, proc = client
    try:
        r = api.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0, **kw)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    except openai.BadRequestError as e:
        assert e.body["param"] in (field if isinstance(field, tuple) else (field,)) and "<state>" not in e.body["message"], e.body
    assert proc.poll() is None, "the server died"
    assert api.chat.completions.create(model="tiny", messages=MSG, max_tokens=2).choices[0].finish_reason


def test_over_http_a_stream_whose_matcher_fails_ends_with_an_error_event(client):
    import openai

    api, proc = client
    with pytest.raises(openai.APIError) as e:
        for _ in api.chat.completions.create(model="tiny", messages=MSG, max_tokens=50, stream=True,
                                             extra_body={"guided_regex": "(ab){300000}"}):
            pass
    assert "guided_regex" in str(e.value.body) or "regex" in str(e.value)
    assert proc.poll() is None


def test_a_row_whose_masks_are_slow_never_holds_a_free_row_back(models):
    """A free row takes its tokens while a row under a costly regex waits for its masks (computed off
    the engine thread); its steps are not the free row's.  Counts tokens, not time."""
    m = models["llama"]
    with slotinfer.Inferencer(m, slots=2, max_len=256) as inf:
        inf.generate([5, 6], regex="a{100000}", max_tokens=2)  # compiled and cached
        seen = []
        slow = inf.submit([5, 6], regex="a{100000}", max_tokens=200, on_token=lambda ev: seen.append(ev))
        free = inf.submit([7, 8], max_tokens=40, ignore_eos=True).result(timeout=120)
        behind = len(seen)
        slow.cancel()
    assert len(free.tokens) == 40 and behind < 20, behind  # in lockstep it would be 39 or 40


def test_a_busy_compiler_is_a_429_with_retry_after_over_http():
    from slotinfer.serve.errors import from_exception

    err = from_exception(GrammarBusy("8 constraints are compiling and 32 more wait; retry in a few seconds"))
    assert err.status == 429 and err.headers.get("Retry-After") and "retry" in err.message
