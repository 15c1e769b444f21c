"""Templates and output files cannot be turned against the user: the Jinja sandbox (chat templates
and ``classify --template``), its time and size limits, and what ``--output`` may overwrite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slotinfer import default_model
from slotinfer import settings as slot_settings
from slotinfer.cli.classify import main as classify_main
from slotinfer.cli.jobs import UsageError, parse_template
from slotinfer.cli.main import main as cli_main
from slotinfer.errors import InvalidRequestError, TemplateError, TokenizerError
from slotinfer.text.templates import _raise_from_template, _strftime_now, _tojson, compile_template, render
from slotinfer.text.templates import sandboxed_environment
from slotinfer.testing import make_tiny_model
from slotinfer.text.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany? 🙂"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("tpl") / "qwen3")


def _chat(folder, tmp_path, template: str) -> Tokenizer:
    """A tokenizer of ``folder`` whose chat template is ``template``."""
    import shutil

    d = tmp_path / "model"
    if not d.exists():
        shutil.copytree(folder, d)
    (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    return Tokenizer.from_folder(d)


# -- the sandbox -----------------------------------------------------------------------

# Each runs `touch MARKER` when rendered without a sandbox (checked in test_escapes_work_unsandboxed).
ESCAPES = {
    "cycler globals": "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "joiner globals": "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "namespace globals": "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
    "self globals": "{{ self.__init__.__globals__.__builtins__['__import__']('os').system('touch MARKER') }}",
    "attr filter": "{{ (cycler|attr('__init__')|attr('__globals__'))['os'].system('touch MARKER') }}",
    "mro subclasses": "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'catch_warnings' %}"
                      "{{ c()._module.__builtins__['__import__']('os').system('touch MARKER') }}{% endif %}{% endfor %}",
    "str.format": "{{ '{0.__init__.__globals__[os].system}'.format(cycler) }}"
                  "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "format_map": "{{ '{c.__init__.__globals__}'.format_map({'c': cycler}) }}"
                  "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
}
_LEAKS = ("<built-in function", "<function", "<module", "<class", "__builtins__")


def _escaped(tmp_path, out: str | None) -> bool:
    return (tmp_path / "MARKER").exists() or (out is not None and any(s in out for s in _LEAKS))


@pytest.mark.parametrize("name", ESCAPES)
def test_escapes_work_unsandboxed(tmp_path, monkeypatch, name):
    """The escapes below are real: plain Jinja runs them (so their failing in the sandbox means something)."""
    import jinja2

    monkeypatch.chdir(tmp_path)
    jinja2.Environment().from_string(ESCAPES[name]).render()
    assert _escaped(tmp_path, None)


@pytest.mark.parametrize("name", ESCAPES)
def test_chat_template_sandbox_resists(folder, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    tok = _chat(folder, tmp_path, ESCAPES[name] + "{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        out = tok.apply_chat_template(MESSAGES)
    except (TokenizerError, InvalidRequestError):
        out = None
    assert not _escaped(tmp_path, out)


@pytest.mark.parametrize("name", ESCAPES)
def test_classify_template_sandbox_resists(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(ESCAPES[name] + " Review: {{ text }}\nAnswer:")
    try:
        out = "".join(p or "" for p in parse_template(str(tmp_path / "t.txt")))
    except UsageError:
        out = None
    assert not _escaped(tmp_path, out)


def test_classify_template_keeps_its_rendering(tmp_path):
    """The sandbox keeps Jinja's defaults for prompt templates: blocks leave their newlines, the last one is dropped."""
    (tmp_path / "t.txt").write_text("{% if 1 %}\nReview{% endif %}: {{ text }}\n{{ 'Verdict' | upper }}:\n")
    assert parse_template(str(tmp_path / "t.txt")) == ("\nReview: ", "\nVERDICT:")


def test_templates_cannot_mutate_their_inputs(folder, tmp_path):
    tok = _chat(folder, tmp_path, "{% set _ = messages.append(1) %}{{ messages|length }}")
    with pytest.raises((TokenizerError, InvalidRequestError)):
        tok.apply_chat_template(MESSAGES)


# -- limits of time and size ------------------------------------------------------------

DOS = {
    "string repetition": ("{{ 'x' * 10**8 }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "list repetition": ("{{ ([1] * 10**8)|length }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(28) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s|length }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "doubling with +": ("{% set ns = namespace(s='x') %}{% for i in range(28) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}{{ ns.s|length }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "output of a loop": ("{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
                         "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "center": ("{{ 'x'|center(100000000) }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "str.center": ("{{ 'x'.center(100000000) }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "format width": ("{{ '{:>100000000}'.format(1) }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "% width": ("{{ '%100000000d' % 1 }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "replace": ("{% set s = 'x' * 10000 %}{{ s|replace('x', s) }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "join": ("{% set s = 'x' * 1000000 %}{{ ([s] * 100)|join }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "power": ("{{ (9 ** (9 ** 9)) > 0 }}", "SLOTINFER_TEMPLATE_MAX_CHARS"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(300) %}{% endfor %}{% endfor %}",
                     "SLOTINFER_TEMPLATE_SECONDS"),
    "recursive macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                        "{{ f(21) }}", "SLOTINFER_TEMPLATE_SECONDS"),
}


@pytest.mark.parametrize("name", DOS)
def test_chat_template_is_bounded(folder, tmp_path, monkeypatch, name):
    template, variable = DOS[name]
    monkeypatch.setenv("SLOTINFER_TEMPLATE_SECONDS", "0.5")
    tok = _chat(folder, tmp_path, template)
    start = time.perf_counter()
    with pytest.raises(TemplateError, match=variable) as e:
        tok.apply_chat_template(MESSAGES)
    assert time.perf_counter() - start < 5
    assert isinstance(e.value, InvalidRequestError) and "raise the limit" in str(e.value)


def test_classify_template_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTINFER_TEMPLATE_SECONDS", "0.5")
    (tmp_path / "t.txt").write_text(DOS["nested loops"][0] + "{{ text }}")
    with pytest.raises(UsageError, match="SLOTINFER_TEMPLATE_SECONDS"):
        parse_template(str(tmp_path / "t.txt"))
    (tmp_path / "t.txt").write_text(DOS["string repetition"][0] + "{{ text }}")
    with pytest.raises(UsageError, match="SLOTINFER_TEMPLATE_MAX_CHARS"):
        parse_template(str(tmp_path / "t.txt"))


def test_deep_recursion_is_a_template_error(folder, tmp_path):
    tok = _chat(folder, tmp_path, "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")
    with pytest.raises(TemplateError, match="too deeply"):
        tok.apply_chat_template(MESSAGES)


def test_arithmetic_errors_are_request_errors(folder, tmp_path):
    tok = _chat(folder, tmp_path, "{{ 1 / 0 }}")
    with pytest.raises(InvalidRequestError, match="ZeroDivisionError"):
        tok.apply_chat_template(MESSAGES)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), k=st.integers(-3, 60), op=st.sampled_from(["*", "~", "+", "center", "join"]))
def test_size_limit_is_exact(n, k, op):
    """Up to the limit a template renders exactly as Python would; one past it, TemplateError."""
    limit = 500
    env = sandboxed_environment()
    src = {"*": "{{ s * k }}", "~": "{% set ns = namespace(t='') %}{% for i in range(k) %}{% set ns.t = ns.t ~ s %}"
                                    "{% endfor %}{{ ns.t }}",
           "+": "{% set ns = namespace(t='') %}{% for i in range(k) %}{% set ns.t = ns.t + s %}{% endfor %}{{ ns.t }}",
           "center": "{{ s|center(k * n) }}", "join": "{{ ([s] * k)|join }}"}[op]
    if op in ("~", "+"):
        k = k % 5  # a few steps: what they build in all stays far below TOTAL_FACTOR x the limit
    want = ("x" * n).center(k * n) if op == "center" else "x" * n * max(k, 0)
    old = os.environ.get("SLOTINFER_TEMPLATE_MAX_CHARS")
    os.environ["SLOTINFER_TEMPLATE_MAX_CHARS"] = str(limit)
    try:
        template = compile_template(env, src)
        if len(want) <= limit and (op != "join" or max(k, 0) <= limit):
            assert render(template, {"s": "x" * n, "k": k, "n": n}) == want
        else:
            with pytest.raises(TemplateError, match=f"{limit:,}"):
                render(template, {"s": "x" * n, "k": k, "n": n})
    finally:
        if old is None:
            del os.environ["SLOTINFER_TEMPLATE_MAX_CHARS"]
        else:
            os.environ["SLOTINFER_TEMPLATE_MAX_CHARS"] = old


@pytest.mark.parametrize("name,value", [("SLOTINFER_TEMPLATE_MAX_CHARS", "0"), ("SLOTINFER_TEMPLATE_MAX_CHARS", "lots"),
                                        ("SLOTINFER_TEMPLATE_SECONDS", "-1"), ("SLOTINFER_TEMPLATE_SECONDS", "inf")])
def test_bad_limit_settings_say_what_is_wrong(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        slot_settings.template_max_chars() if "CHARS" in name else slot_settings.template_seconds()


def _real_templates() -> dict[str, str]:
    from slotinfer.testing.tokenizers import _template

    found = {name: _template(name) for name in ("llama3", "qwen2", "qwen3", "gemma")}
    gguf = default_model.path()
    if gguf is not None:
        import mlx.core as mx

        found["smollm2-gguf"] = mx.load(str(gguf), return_metadata=True)[1]["tokenizer.chat_template"]
    return found


@pytest.fixture(scope="module")
def real_templates():
    return _real_templates()


def _plain_render(src: str, context: dict) -> str:
    """The chat template as Jinja's own sandbox renders it (no limits): the reference."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(src).render(**context)


message_st = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                    "content": st.text(max_size=40)})


@settings(max_examples=25, deadline=None)
@given(messages=st.lists(message_st, min_size=1, max_size=6), system=st.booleans(), gen=st.booleans())
def test_real_chat_templates_render_as_before(real_templates, messages, system, gen):
    msgs = ([{"role": "system", "content": "Be brief."}] if system else []) + messages
    ctx = {"messages": msgs, "add_generation_prompt": gen, "bos_token": "<s>", "eos_token": "</s>"}
    from slotinfer.text.tokenizer import _jinja_env

    for name, src in real_templates.items():
        try:
            want = _plain_render(src, ctx)
        except InvalidRequestError as e:  # the template refuses these messages: so must the sandbox
            with pytest.raises(InvalidRequestError, match=str(e)[:30]):
                render(compile_template(_jinja_env(), src), ctx)
            continue
        assert render(compile_template(_jinja_env(), src), ctx) == want, name


# -- classify --output ---------------------------------------------------------------------

def _classify(model, src, out, *extra, labels="yes,no"):
    return classify_main(["--model", str(model), "--labels", labels, "-q", *extra, "--output", str(out), str(src)])


def test_an_unrelated_file_is_never_resumed(folder, tmp_path, capsys):
    src, notes = tmp_path / "in.txt", tmp_path / "notes.txt"
    src.write_text("good one\nanother\n")
    notes.write_bytes(b"my notes\nline two without a newline")
    assert _classify(folder, src, notes) == 2
    assert notes.read_bytes() == b"my notes\nline two without a newline"
    err = capsys.readouterr().err
    assert "is not an output of this command" in err and "line 1" in err


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
def test_the_input_is_never_the_output(folder, tmp_path, capsys, how):
    src = tmp_path / "in.jsonl"
    data = b'{"id": 1, "text": "first"}\n{"id": 2, "text": "last line, no newline"}'
    src.write_bytes(data)
    out = src
    if how == "symlink":
        out = tmp_path / "link.jsonl"
        out.symlink_to(src)
    elif how == "hard link":
        out = tmp_path / "hard.jsonl"
        os.link(src, out)
    assert _classify(folder, src, out) == 2
    assert src.read_bytes() == data and "is the input" in capsys.readouterr().err


def test_resume_only_with_the_same_labels_prefix_and_template(folder, tmp_path, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("good one\nanother\n")
    assert _classify(folder, src, out) == 0
    first = out.read_bytes()
    recs = [json.loads(x) for x in first.splitlines()]
    assert len(recs) == 2 and len({r["run"] for r in recs}) == 1
    (tmp_path / "t.txt").write_text("Review: {{ text }}\nAnswer:")
    for extra, labels in [((), "yes,no,maybe"), (("--label-prefix", " "), "yes,no"), (("--prefix", "Say: "), "yes,no"),
                          (("--template", str(tmp_path / "t.txt")), "yes,no")]:
        assert _classify(folder, src, out, *extra, labels=labels) == 2
        assert out.read_bytes() == first
        assert "other labels, --label-prefix, --prefix or --template" in capsys.readouterr().err
    src.write_text("good one\nanother\nthird\n")
    assert _classify(folder, src, out) == 0  # the same run resumes: one new record
    after = out.read_bytes()
    assert after.startswith(first) and len(after.splitlines()) == 3


def test_a_torn_last_record_is_dropped_and_redone(folder, tmp_path):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("good one\nanother\n")
    assert _classify(folder, src, out) == 0
    whole = out.read_bytes()
    lines = whole.splitlines(keepends=True)
    out.write_bytes(lines[0] + lines[1][:17])  # a crash mid-write
    assert _classify(folder, src, out) == 0
    assert sorted(json.loads(x)["id"] for x in out.read_bytes().splitlines()) == [1, 2]
    out.write_bytes(whole.rstrip(b"\n"))  # complete, without its newline: kept, not cut
    src.write_text("good one\nanother\nthird\n")
    assert _classify(folder, src, out) == 0
    assert sorted(json.loads(x)["id"] for x in out.read_bytes().splitlines()) == [1, 2, 3]


def test_a_non_record_last_line_is_not_cut(folder, tmp_path):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("good one\n")
    assert _classify(folder, src, out) == 0
    data = out.read_bytes() + b"a note of mine"
    out.write_bytes(data)
    assert _classify(folder, src, out) == 2 and out.read_bytes() == data


def _slotinfer(*args, **kw):
    return subprocess.run([sys.executable, "-m", "slotinfer", *map(str, args)], capture_output=True, timeout=240, **kw)


@pytest.mark.slow  # the CLI as a subprocess
def test_output_to_dev_stdout_in_a_pipe_does_not_hang(folder, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("good one\nanother\n")
    proc = _slotinfer("classify", "--model", folder, "--labels", "yes,no", "-q", "--output", "/dev/stdout", src)
    recs = [json.loads(x) for x in proc.stdout.splitlines()]
    assert proc.returncode == 0 and [r["id"] for r in recs] == [1, 2]


@pytest.mark.slow  # the CLI as a subprocess
def test_ctrl_c_exits_130_in_one_line_and_the_run_resumes(folder, tmp_path):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    n = 20000
    src.write_text("".join(f"sentence number {i}\n" for i in range(n)))
    args = ["classify", "--model", folder, "--labels", "yes,no", "--label-prefix", " ", "-q", "--chunk", "64", "--output",
            out, src]
    proc = subprocess.Popen([sys.executable, "-m", "slotinfer", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # SIGINT at its default, as from a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while not (out.exists() and out.stat().st_size > 0) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    ours = [line for line in err.splitlines() if "Warning" not in line and "BLAS = " not in line]  # BLAS advice aside
    assert proc.returncode == 130 and "Traceback" not in err and len(ours) == 1, err
    assert ours[0].startswith("slotinfer classify: interrupted: "), err
    done = len(out.read_bytes().splitlines())
    assert 0 < done < n
    proc = _slotinfer(*args)
    ids = [json.loads(x)["id"] for x in out.read_bytes().splitlines()]
    assert proc.returncode == 0 and sorted(ids) == list(range(1, n + 1))


@pytest.mark.slow  # the CLI as a subprocess
def test_generate_refuses_to_write_over_its_stdin(folder, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nsecond\n")
    with open(prompts, "rb") as fh:
        proc = _slotinfer("generate", "--model", folder, "--max-tokens", "2", "--output", prompts, stdin=fh)
    assert proc.returncode == 2 and b"is standard input" in proc.stderr
    assert prompts.read_text() == "hello there\nsecond\n"


def test_ray_output_follows_the_same_rules(folder, tmp_path, capsys):
    """``--ray`` refuses before any cluster starts: a file that is not its own, or its input."""
    pytest.importorskip("ray")
    src, notes = tmp_path / "in.jsonl", tmp_path / "notes.jsonl"
    src.write_text('{"id": 1, "text": "good one"}\n')
    notes.write_bytes(b"my notes, no newline")
    assert classify_main(["--ray", "--model", str(folder), "--labels", "yes,no", "-q", str(src), "-o", str(notes)]) == 2
    assert notes.read_bytes() == b"my notes, no newline" and "not an output of this command" in capsys.readouterr().err
    assert cli_main(["generate", "--ray", "--model", str(folder), str(src), "--output", str(src)]) == 2
    assert src.read_text() == '{"id": 1, "text": "good one"}\n' and "is the input" in capsys.readouterr().err
