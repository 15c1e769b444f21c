"""Shared fixtures: one tiny model per family, written in published layouts and loaded for real."""

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

import slotinfer
from slotinfer.testing import FAMILIES, make_tiny_model

settings.register_profile(
    "ci", max_examples=int(os.environ.get("SLOTINFER_EXAMPLES", "12")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
settings.load_profile("ci")


def _loop_sets():
    """The native extension's loop sets this CPU runs (none where it is not built)."""
    from slotinfer.cpu import qkernel

    module = qkernel.load()
    names = ["portable", "avx2", "avx512"]
    return names[:names.index(module.best_kernels()) + 1] if module else []


@pytest.fixture(params=_loop_sets())
def kernels(request):
    """Each loop set of slotinfer's native extension in turn (tests/cpu/test_qkernel.py, test_decode_ops.py)."""
    from slotinfer.cpu import qkernel

    module = qkernel.load()
    module.set_kernels(request.param)
    yield request.param
    module.set_kernels(module.best_kernels())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")

    def get(family, **kw):
        name = family + "".join(f"-{k}={v}" for k, v in sorted(kw.items()))
        path = root / name
        if not path.exists():
            make_tiny_model(family, path, **kw)
        return path

    return get


@pytest.fixture(scope="session")
def models(model_dir):
    return {f: slotinfer.load(model_dir(f)) for f in FAMILIES}


@pytest.fixture(scope="session")
def smollm2():
    """The real model, SmolLM2-135M-Instruct from its GGUF (skips where the wheel is not installed)."""
    from slotinfer import default_model

    path = default_model.path()
    if path is None:
        pytest.skip(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    return slotinfer.load(path)


@pytest.fixture
def head_1():
    """``python -m slotinfer ARGS < stdin | head -1``: (exit status, the first line, stderr)."""

    def run(args, stdin: bytes):
        proc = subprocess.Popen([sys.executable, "-m", "slotinfer", *map(str, args)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdin.write(stdin)  # far more than a pipe holds: the writer meets the closed end
        proc.stdin.close()
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        return proc.wait(timeout=120), first, err

    return run
