"""The command-line pieces around the server: ``slotinfer generate`` (streaming, records, chat,
sampling flags, progress) and ``slotinfer --version``, on a real tiny model."""

import io
import json
import re
import subprocess
import sys

import pytest

import slotinfer
from test_cli import _cli


@pytest.fixture(scope="module")
def folder(model_dir):
    return str(model_dir("qwen3"))


@pytest.fixture(scope="module")
def model(folder):
    return slotinfer.load(folder)


def test_version():
    out = subprocess.run([sys.executable, "-m", "slotinfer", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"slotinfer {slotinfer.__version__}"


def test_one_prompt_streams_its_text(folder, model, capsys):
    rc, out, _ = _cli(["generate", "--model", folder, "--max-tokens", "12", "Once upon"], capsys)
    assert rc == 0 and out == model.generate("Once upon", max_tokens=12).text + "\n"


def test_chat_records_the_users_text(folder, model, capsys, tmp_path):
    dest = tmp_path / "out.jsonl"
    rc, out, err = _cli(["generate", "--model", folder, "--max-tokens", "6", "--system", "Be brief.", "--output",
                         str(dest), "--progress", "hi", "bye"], capsys)
    assert rc == 0 and out == ""
    recs = [json.loads(x) for x in dest.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == ["hi", "bye"]
    for r, user in zip(recs, ["hi", "bye"]):
        want = model.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}], max_tokens=6)
        assert (r["text"], r["completion_tokens"]) == (want.text, len(want.tokens))
    assert "2/2" in err  # the progress bar


def test_sampling_flags_are_the_librarys(folder, model, capsys, monkeypatch):
    ref = model.generate("The sea", max_tokens=30, ignore_eos=True).text
    stop = ref[10:12]
    flags = ["--max-tokens", "20", "--temperature", "0.8", "--min-p", "0.05", "--repetition-penalty", "1.3",
             "--seed", "5", "--stop", stop]
    monkeypatch.setattr("sys.stdin", io.StringIO("The sea\nA cat\n"))
    rc, out, _ = _cli(["generate", "--model", folder, *flags], capsys)
    recs = [json.loads(x) for x in out.splitlines()]
    for i, (r, p) in enumerate(zip(recs, ["The sea", "A cat"])):
        want = model.generate(p, max_tokens=20, temperature=0.8, min_p=0.05, repetition_penalty=1.3, seed=5 + i,
                              stop=[stop])
        assert (r["text"], r["finish_reason"]) == (want.text, want.finish_reason)


def test_logprobs_are_recorded(folder, model, capsys):
    rc, out, _ = _cli(["generate", "--model", folder, "--max-tokens", "5", "--logprobs", "2", "Hello"], capsys)
    [rec] = [json.loads(x) for x in out.splitlines()]
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf:
        want = inf.generate("Hello", max_tokens=5, logprobs=True, top_logprobs=2)
    # tokens by their text, as the server's logprobs show them (each token decoded alone), ids beside
    text = model.tokenizer.decode
    assert rec["tokens"] == [text([t]) for t in want.tokens] and rec["token_ids"] == want.tokens
    assert rec["logprobs"] == pytest.approx(want.logprobs)
    assert [[(e["token"], e["id"]) for e in top] for top in rec["top_logprobs"]] == \
        [[(text([t]), t) for t, _ in top] for top in want.top_logprobs]
    assert [e["logprob"] for top in rec["top_logprobs"] for e in top] == \
        pytest.approx([v for top in want.top_logprobs for _, v in top])


@pytest.mark.parametrize("flag,value", [("--min-p", "1.5"), ("--repetition-penalty", "0"), ("--stop", ""),
                                        ("--logprobs", "-1")])
def test_bad_generate_flags_are_usage_errors(folder, capsys, flag, value):
    rc, out, err = _cli(["generate", "--model", folder, flag, value, "hello"], capsys)
    assert rc == 2 and out == "" and f"argument {flag}:" in err


def test_serve_without_a_model_is_a_usage_error(capsys):
    rc, _, err = _cli(["serve"], capsys)
    assert rc == 2 and "model" in err
    rc, _, err = _cli(["serve", "models/a", "--model", "models/b"], capsys)  # --model as every command takes it
    assert rc == 2 and "'models/a'" in err and "'models/b'" in err and "once" in err, err


def test_serve_help_gives_the_defaults_and_how_the_server_samples(capsys):
    rc, out, _ = _cli(["serve", "--help"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "--model MODEL" in text and "--prefill-tokens N" in text
    for flag, default in [("--port PORT", "8000"), ("--slots SLOTS", "32"), ("--prefill-tokens N", "512"),
                          ("--max-queue MAX_QUEUE", "64"), ("--grace-period GRACE_PERIOD", "10.0"),
                          ("--read-timeout READ_TIMEOUT", "30.0"), ("--log-level", "info")]:
        after = text[text.index(flag + " ", text.index("options:")):]
        assert f"(default: {default})" in after[2:].split(" --")[0], (flag, after[:300])
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "temperature is sampled at 1.0, as OpenAI's API does" in text and "generate is greedy" in text


def test_install_advice_is_the_checkouts():
    """slotinfer is not on PyPI: advice to `pip install slotinfer...` would fetch whatever someone
    uploads under that name. Docs, error messages and help give the checkout's `pip install -e`."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "slotinfer").rglob("*.py")]
    advice = re.compile(r"pip install[^\n`#]*?[\s'\"]slotinfer\b")
    found = [f"{f.relative_to(root)}: {m.group(0)}" for f in files for m in advice.finditer(f.read_text())]
    assert not found, found


@pytest.mark.parametrize("command", ["classify", "generate", "serve", "bench", "demo"])
def test_help_is_plain_text_for_users(command, capsys):
    """No reST markup or notes for developers in --help, and --model (MODEL) says everything load takes."""
    rc, out, _ = _cli([command, "--help"], capsys)
    assert rc == 0
    for markup in ("``", ":mod:", ":class:", ":meth:", ":func:", "Why one module"):
        assert markup not in out, markup
    model_help = re.search(r"\n  (?:--model \w+|model)\s+(.*?)(?:\n  -|\n\n|\n?$)", out, re.S)[1]
    assert all(w in " ".join(model_help.split()) for w in ("folder", "GGUF", "hub id")), model_help


def test_the_demos_help_names_its_model(capsys):
    _, out, _ = _cli(["--help"], capsys)
    assert "SmolLM2-135M-Instruct" in re.search(r"\n\s+demo\s+(.*?)\n\s+\w+  ", out, re.S)[1]


def test_lengths_past_the_models_context_are_refused(folder, model, capsys):
    ctx = model.context_length
    rc, out, err = _cli(["generate", "--model", folder, "--max-tokens", str(ctx * 10), "hello"], capsys)
    assert rc == 2 and out == "" and "--max-tokens" in err and str(ctx) in err, err
    proc = subprocess.run([sys.executable, "-m", "slotinfer", "serve", folder, "--port", "0", "--slots", "1",
                           "--max-len", str(ctx * 10)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--max-len" in proc.stderr and str(ctx) in proc.stderr, proc.stderr


def test_an_empty_prompt_is_an_error_exit(folder, capsys):
    rc, out, err = _cli(["generate", "--model", folder, ""], capsys)
    assert rc == 2 and out == "" and "empty" in err, (rc, out, err)
    rc, out, err = _cli(["generate", "--model", folder, "--max-tokens", "2", "fine", ""], capsys)
    records = [json.loads(line) for line in out.splitlines()]
    assert rc == 1 and [r["finish_reason"] for r in records] == ["length", "error"] and "1 of 2" in err
