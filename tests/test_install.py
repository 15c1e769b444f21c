"""Installing from the checkout, as README says (``pip install -e .``), says nothing but errors."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# pip's PEP 517 steps (with `build`, the PyPA's frontend made for them): a fresh isolated environment
# with pyproject's build-system.requires, then the backend's editable build in it, so the setuptools
# that runs is the one `pip install -e .` gets, never the test venv's own (a venv that Python 3.11
# seeds holds setuptools 65.5, which cannot read pyproject's `license = "MIT"`; one on 3.12 holds none)
BUILD = """
import sys
from build import ProjectBuilder
from build.env import DefaultIsolatedEnv
src, out = sys.argv[1:]
with DefaultIsolatedEnv() as env:
    builder = ProjectBuilder.from_isolated_env(env, src)
    env.install(builder.build_system_requires)
    env.install(builder.get_requires_for_build("editable"))
    print(builder.build("editable", out))
"""


def test_the_editable_build_is_quiet(tmp_path):
    """The editable wheel pip builds (PEP 660): no setuptools notice boxes, no compiler notes.
    Never skipped: `build` is in the test extra, and a skip here once hid a build that failed."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "slotinfer", src / "slotinfer", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-c", BUILD, str(src), str(tmp_path / "dist")], cwd=src,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert list((tmp_path / "dist").glob("slotinfer-*.whl")), proc.stdout[-2000:]
    said = proc.stdout + proc.stderr
    for noise in ("Editable install will be performed", "Editable installation", "note: the ABI", "*******"):
        assert noise not in said, said[-3000:]
