"""Installing from the checkout, as README says (``pip install -e .``), says nothing but errors."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_editable_build_is_quiet(tmp_path):
    """The editable wheel pip builds (PEP 660): no setuptools notice boxes, no compiler notes."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "slotinfer", src / "slotinfer", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = f"from setuptools import build_meta; print(build_meta.build_editable({str(tmp_path)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    for noise in ("Editable install will be performed", "Editable installation", "note: the ABI", "*******"):
        assert noise not in said, said[-3000:]
