"""The ``slotinfer`` command line: ``generate`` and ``bench`` argument handling, on a real tiny model."""

from __future__ import annotations

import argparse
import io
import json
import re

import pytest

from slotinfer.cli.bench import add_arguments
from slotinfer.cli.main import main


def _cli(argv, capsys):
    """(exit code, stdout, stderr) of ``slotinfer ARGV``; argparse's usage errors exit through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_generate_strips_crlf_from_stdin(model_dir, monkeypatch, capsys):
    model = str(model_dir("qwen3"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\r\n\r\nsecond\r\n"))
    rc, out, _ = _cli(["generate", "--model", model, "--max-tokens", "3"], capsys)
    from_stdin = [json.loads(x) for x in out.splitlines()]
    rc_args, out, _ = _cli(["generate", "--model", model, "--max-tokens", "3", "hello there", "second"], capsys)
    assert rc == rc_args == 0 and [r["prompt"] for r in from_stdin] == ["hello there", "second"]
    assert from_stdin == [json.loads(x) for x in out.splitlines()]


@pytest.mark.parametrize("flag,value", [
    ("--slots", "0"), ("--slots", "-1"), ("--max-tokens", "0"), ("--temperature", "-1"), ("--temperature", "nan"),
    ("--top-p", "0"), ("--top-k", "-2"), ("--seed", "-1"),
])
def test_generate_bad_arguments_are_usage_errors(model_dir, capsys, flag, value):
    rc, out, err = _cli(["generate", "--model", str(model_dir("qwen3")), flag, value, "hello"], capsys)
    assert rc == 2 and out == ""  # before any prompt runs
    assert f"slotinfer generate: error: argument {flag}:" in err and "Traceback" not in err


def test_generate_constrains_every_output(model_dir, tmp_path, capsys):
    model = str(model_dir("llama"))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"], "additionalProperties": False}))
    rc, out, _ = _cli(["generate", "--model", model, "--max-tokens", "12", "--json-schema", str(schema),
                       "one", "two", "three"], capsys)
    records = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and len(records) == 3
    assert all(type(json.loads(r["text"])["ok"]) is bool and r["finish_reason"] == "stop" for r in records)
    rc, out, _ = _cli(["generate", "--model", model, "--choice", "north", "--choice", "south", "a", "b"], capsys)
    assert rc == 0 and {json.loads(x)["text"] for x in out.splitlines()} <= {"north", "south"}


@pytest.mark.parametrize("args", [["--json-schema", "/no/such/schema.json"], ["--json-schema", "{}", "--regex", "a"],
                                  ["--json-schema", "NOT_JSON"]])
def test_generate_bad_constraints_are_usage_errors(model_dir, tmp_path, capsys, args):
    if args[1] != "/no/such/schema.json":
        (tmp_path / args[1]).write_text(args[1])
        args = [args[0], str(tmp_path / args[1]), *args[2:]]
    rc, out, err = _cli(["generate", "--model", str(model_dir("qwen3")), *args, "hello"], capsys)
    assert rc == 2 and out == "" and "slotinfer generate: error: argument --" in err and "Traceback" not in err


@pytest.mark.parametrize("flag,value", [
    ("--slots", "abc"), ("--slots", "0"), ("--slots", "1,,8"), ("--slots", "8,-1"), ("--repeats", "0"),
    ("--gen-tokens", "0"), ("--mixed-slots", "0"),
])
def test_bench_bad_arguments_are_usage_errors(capsys, flag, value):
    rc, out, err = _cli(["bench", flag, value], capsys)
    assert rc == 2 and out == "" and f"slotinfer bench: error: argument {flag}:" in err


def test_bench_slots_parse_to_ints():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).slots == [1, 8, 32]
    assert p.parse_args(["--slots", "2, 4"]).slots == [2, 4]


@pytest.mark.slow  # the CLI as a subprocess
def test_generate_into_a_closed_pipe_exits_quietly(model_dir, head_1):
    prompts = "".join(f"prompt {i}\n" for i in range(3000)).encode()
    rc, first, err = head_1(["generate", "--model", model_dir("qwen3"), "--max-tokens", "1"], prompts)
    assert rc == 1 and json.loads(first)["prompt"] == "prompt 0"
    assert "Traceback" not in err and "BrokenPipe" not in err



@pytest.mark.slow  # a subprocess of the CLI
def test_ctrl_c_during_classify_writes_what_is_done_and_a_rerun_finishes_it(model_dir, tmp_path):
    """Interrupted, classify keeps every record it wrote (whole lines) and exits 130; run again, it
    classifies the rest, each sentence once."""
    import random
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(0)
    words = ["good", "bad", "food", "day", "nice", "the", "a", "movie", "was", "not"]
    src, dest = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("".join(" ".join(rng.choice(words) for _ in range(8)) + "\n" for _ in range(3000)))
    command = [sys.executable, "-m", "slotinfer", "classify", "--model", str(model_dir("qwen3")),
               "--labels", "very good,quite bad", "--output", str(dest), "-q", str(src)]
    # SIGINT at its default in the child, as from a terminal (a runner started in the background
    # of a script passes it on ignored, and Python then keeps it ignored)
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    end = time.monotonic() + 120
    while not dest.exists() or dest.read_bytes().count(b"\n") < 300:
        assert proc.poll() is None and time.monotonic() < end, proc.stderr.read()
        time.sleep(0.02)
    shown = dest.read_bytes().count(b"\n")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    err = proc.stderr.read()
    proc.stderr.close()
    kept = [json.loads(line) for line in dest.read_text().splitlines()]
    assert shown <= len(kept) < 3000
    said = re.search(r"interrupted: (\d+) sentences written in .*out\.jsonl; the same command resumes", err)
    assert said and int(said[1]) == len(kept), err  # what it says is what the file holds
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    ids = [json.loads(line)["id"] for line in dest.read_text().splitlines()]
    assert sorted(ids) == list(range(1, 3001))


@pytest.mark.parametrize("name, value", [("SLOTINFER_ATTENTION_STREAMS", "0"), ("SLOTINFER_ATTENTION_STREAMS", "two")])
def test_a_bad_setting_is_one_line_not_a_traceback(monkeypatch, capsys, name, value):
    """A SLOTINFER_* variable the CLI cannot take: exit status 2 and a line naming it, its value and what it takes."""
    monkeypatch.setenv(name, value)
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slotinfer: error: {name}={value!r}: expected ") and err.count("\n") == 1, err
