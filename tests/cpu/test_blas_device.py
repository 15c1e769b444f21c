"""BLAS loading (slotinfer.cpu.blas) and the device policy (slotinfer.device).

The BLAS is chosen once per process, so every SLOTINFER_BLAS case runs in a
fresh interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import glob
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer  # first: loads the BLAS before mlx.core
import mlx.core as mx
from slotinfer import device
from slotinfer.errors import InvalidRequestError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINUX = sys.platform == "linux"
OPTIONS = ["openblas-scipy", "openblas-numpy", "openblas-system", "mkl"]


THREAD_VARS = ("SLOTINFER_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _py(code: str, blas: str | None = None, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SLOTINFER_BLAS", "LD_PRELOAD") + THREAD_VARS}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    if blas is not None:
        env["SLOTINFER_BLAS"] = blas
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def _installed() -> dict[str, bool]:
    """Which BLAS options are present, found independently of slotinfer.cpu.blas."""
    shim = bool(glob.glob(os.path.join(ROOT, "slotinfer", "cpu", "_blas_shim*.so")))  # built at install time
    np_dir = os.path.dirname(os.path.dirname(importlib.util.find_spec("numpy").origin))
    return {
        "openblas-scipy": shim and importlib.util.find_spec("scipy_openblas32") is not None,
        "openblas-numpy": shim and bool(glob.glob(os.path.join(np_dir, "numpy.libs", "libscipy_openblas64_*.so"))),
        "openblas-system": ctypes.util.find_library("openblas") is not None,
        "mkl": bool(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*"))),
    }


_IMPORT_RECORDING = """
import json, warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    {pre}
    import slotinfer
    slotinfer.cpu.blas.ensure_blas()  # idempotent: no second warning
msgs = [str(m.message) for m in w if "BLAS" in str(m.message)]
print(json.dumps({{"name": slotinfer.BLAS.name, "optimized": slotinfer.BLAS.optimized, "warnings": msgs}}))
"""

# f32 (sgemm), f64 (dgemm) and complex64 (cgemm) through MLX, against numpy in float64.
_MATMUL_VS_NUMPY = """
import json, numpy as np, slotinfer, mlx.core as mx
rng = np.random.default_rng(0)
err = {}
# One row / one column take the shim's gemv route; transposed views exercise the flags.
for m, n, k in [(1, 3072, 1024), (8, 1024, 3072), (32, 1000, 1000), (3, 5, 7), (6, 1, 300), (1, 1, 50)]:
    x, w = rng.standard_normal((m, k)), rng.standard_normal((n, k))
    xm, wm = mx.array(x.astype(np.float32)), mx.array(w.astype(np.float32))
    for name, got in [("x @ w.T", xm @ wm.T), ("x.T.T @ w", mx.array(x.T.astype(np.float32)).T @ wm.T),
                      ("w @ x.T", (wm @ xm.T).T)]:
        err[f"f32 {name} {m}x{n}x{k}"] = float(np.abs(np.array(got) - x @ w.T).max() / np.abs(x @ w.T).max())
with mx.stream(mx.cpu):
    got = np.array(mx.array(x, dtype=mx.float64) @ mx.array(w, dtype=mx.float64).T)
    err["f64"] = float(np.abs(got - x @ w.T).max())
    cx, cw = (x + 2j * x).astype(np.complex64), (w - 1j * w).astype(np.complex64)
    got = np.array(mx.array(cx) @ mx.array(cw).T)
    err["c64"] = float(np.abs(got - cx.astype(complex) @ cw.T.astype(complex)).max())
print(json.dumps({"name": slotinfer.BLAS.name, "optimized": slotinfer.BLAS.optimized, "err": err}))
"""


@pytest.mark.skipif(not LINUX, reason="MLX uses Accelerate / GPU off Linux")
def test_optimized_blas_loaded_when_installed():
    if os.environ.get("SLOTINFER_BLAS"):
        pytest.skip("SLOTINFER_BLAS is set for this run")
    if not any(_installed().values()):
        pytest.skip("no optimized BLAS installed (pip install scipy-openblas32, or apt-get install libopenblas0-pthread)")
    assert slotinfer.BLAS.optimized, slotinfer.BLAS
    assert slotinfer.BLAS.name in OPTIONS + ["preloaded"]
    assert slotinfer.BLAS.path and os.path.exists(slotinfer.BLAS.path)


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_blas_none_gives_reference_and_exactly_one_warning():
    out = _py(_IMPORT_RECORDING.format(pre="pass"), blas="none")
    assert out["name"] == "reference" and out["optimized"] is False
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "pip install scipy-openblas32" in out["warnings"][0]


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_mlx_imported_first_warns_once():
    out = _py(_IMPORT_RECORDING.format(pre="import mlx.core"))
    assert out["optimized"] is False
    assert len(out["warnings"]) == 1 and "import slotinfer first" in out["warnings"][0]
    assert "pip install" not in out["warnings"][0]  # the BLAS is installed; the order is what to fix


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_unknown_blas_name_warns_and_keeps_reference():
    out = _py(_IMPORT_RECORDING.format(pre="pass"), blas="no-such-blas")
    assert out["name"] == "reference" and len(out["warnings"]) == 1
    assert "no-such-blas" in out["warnings"][0]


@pytest.mark.skipif(not LINUX, reason="Linux only")
@pytest.mark.parametrize("blas", ["none"] + OPTIONS)
def test_matmul_matches_numpy(blas):
    if blas != "none" and not _installed()[blas]:
        pytest.skip(f"{blas} not installed here")
    out = _py(_MATMUL_VS_NUMPY, blas=blas)
    assert out["name"] == ("reference" if blas == "none" else blas)
    assert out["optimized"] is (blas != "none")
    for case, err in out["err"].items():
        assert err < 1e-4, (case, err)  # f32 sums of 3072 terms; a wrong ABI gives O(1)


_BINDING = """
import json, os, re, slotinfer, mlx.core as mx
x = mx.ones((64, 64))
mx.eval(x @ x)
log = open(os.environ["LD_DEBUG_OUTPUT"] + "." + str(os.getpid())).read()
bound = re.findall(r"binding file \\S*libmlx\\.so \\S+ to (\\S+) \\S+: normal symbol `cblas_sgemm'", log)
print(json.dumps({"name": slotinfer.BLAS.name, "path": slotinfer.BLAS.path, "note": slotinfer.BLAS.note,
                  "bound": bound}))
"""


@pytest.mark.skipif(not LINUX, reason="Linux only")
@pytest.mark.parametrize("blas", [None, "none"])
def test_mlx_matmul_binds_to_the_blas_slotinfer_reports(blas, tmp_path):
    """The dynamic linker's own record of where MLX's cblas_sgemm resolved: the optimized BLAS (or
    the shim in front of it) when slotinfer says one is active, MLX's own reference otherwise."""
    out = _py(_BINDING, blas=blas, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    assert len(out["bound"]) == 1, out
    target = os.path.realpath(out["bound"][0])
    if out["name"] in OPTIONS:
        assert target == os.path.realpath(out["path"]) or ("shim" in out["note"] and "_blas_shim" in target), out
    else:
        assert blas == "none" or not any(_installed().values()), out
        assert "blas_shim" not in target and "openblas" not in target and "mkl" not in target, out


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_thread_count():
    code = "import json, slotinfer; print(json.dumps([slotinfer.BLAS.name, slotinfer.BLAS.threads]))"
    name, default = _py(code)
    if name not in OPTIONS:
        pytest.skip("no optimized BLAS loaded")
    assert default == slotinfer.cpu.blas.usable_cores()
    assert _py(code, SLOTINFER_BLAS_THREADS="1")[1] == 1
    assert _py(code, OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")[1] == 1


def test_ensure_blas_is_idempotent():
    assert slotinfer.cpu.blas.ensure_blas() is slotinfer.BLAS


# -- device policy ------------------------------------------------------------

def test_default_device_matches_mlx():
    assert device.default_device() == ("gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu")


@pytest.mark.parametrize("stored", [mx.float32, mx.float16, mx.bfloat16, "bfloat16"])
def test_cpu_computes_in_float32(stored):
    assert device.compute_dtype(stored, "cpu") == mx.float32
    assert device.compute_dtype(stored, mx.Device(mx.cpu)) == mx.float32


def test_gpu_keeps_stored_dtype():
    for d in (mx.float32, mx.float16, mx.bfloat16):
        assert device.compute_dtype(d, "gpu") == d
    assert device.compute_dtype("float16", "gpu") == mx.float16
    assert device.compute_dtype(mx.float64, "gpu") == mx.float32


def test_override_wins():
    assert device.compute_dtype(mx.float32, "cpu", override="bfloat16") == mx.bfloat16
    assert device.compute_dtype(mx.bfloat16, "gpu", override=mx.float32) == mx.float32
    assert device.compute_dtype(mx.float32, "cpu", override="Float16") == mx.float16


@pytest.mark.parametrize("bad", ["fp8", "int8", "", mx.int32, 16])
def test_bad_dtype_override_raises(bad):
    with pytest.raises(InvalidRequestError, match="float32, float16, bfloat16"):
        device.compute_dtype(mx.float32, "cpu", override=bad)
    with pytest.raises(ValueError):  # InvalidRequestError is a ValueError too
        device.compute_dtype(mx.float32, "gpu", override=bad)


def test_keep_quantized_policy():
    assert device.keep_quantized("cpu") is False
    assert device.keep_quantized("gpu") is True
    assert device.keep_quantized("cpu", override=True) is True
    assert device.keep_quantized("gpu", override=False) is False
    with pytest.raises(InvalidRequestError):
        device.keep_quantized("cpu", override="yes")


def test_bad_device_raises():
    with pytest.raises(InvalidRequestError, match="'cpu' or 'gpu'"):
        device.compute_dtype(mx.float16, "tpu")


_FAULTS = """
import ctypes, resource, sys
import slotinfer.device as device
tuned = device.retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 20 << 20  # a 32-slot LM head's logits are ~19 MB
def step():  # allocate, touch and free three activations, as a step does
    ps = [libc.malloc(size) for _ in range(3)]
    for p in ps:
        ctypes.memset(p, 1, size)
    for p in reversed(ps):
        libc.free(p)
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(not (LINUX and __import__("platform").libc_ver()[0] == "glibc"), reason="glibc malloc tuning")
@pytest.mark.skipif(device.default_device() != "cpu", reason="a CPU policy")
def test_freed_memory_is_reused_without_page_faults():
    """The CPU policy keeps freed activations in the process: repeated steps touch no
    fresh pages.  Left alone when the user tunes glibc's malloc (then the pages come back
    zeroed by the kernel every step, which is what the policy avoids)."""
    def run(**env):
        e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, cwd=ROOT,
                             env={**e, **env}, timeout=120)
        assert out.returncode == 0, out.stderr
        tuned, faults = out.stdout.split()
        return tuned == "True", int(faults)

    tuned, faults = run()
    assert tuned and faults < 1000
    respected, faults_user = run(MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="131072")
    assert not respected and faults_user > 10 * 3 * (20 << 20) // 4096 // 2


def test_describe():
    d = device.describe()
    assert d["mlx"] == mx.__version__
    assert d["device"] == device.default_device()
    assert d["blas"]["name"] == slotinfer.BLAS.name and d["blas"]["optimized"] == slotinfer.BLAS.optimized
    assert d["compute_dtype_for_bfloat16"] == ("float32" if d["device"] == "cpu" else "bfloat16")
    assert d["keep_quantized"] is (d["device"] == "gpu")
    assert isinstance(d["retain_freed_memory"], bool)
    assert (d["prefill_by_layer_from_tokens"] > 0) is (d["device"] == "cpu")  # GPU: one graph
    assert d["cpu_count"] == os.cpu_count()
    json.dumps(d)  # loggable as is


# -- the shim's own small products ----------------------------------------------

SHIM = bool(slotinfer.BLAS.note and "shim" in slotinfer.BLAS.note)
needs_shim = pytest.mark.skipif(not SHIM, reason="the BLAS is not loaded through slotinfer's shim")
# Every property of the shim's loops holds on both kernel sets: the AVX2+FMA one this CPU
# may run and the portable one that any other CPU runs.
kernel_sets = pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])


@contextlib.contextmanager
def kernels(portable: bool):
    assert slotinfer.cpu.blas.use_portable_kernels(portable) == portable or not portable
    try:
        yield
    finally:
        slotinfer.cpu.blas.use_portable_kernels(False)


@needs_shim
@kernel_sets
@given(m=st.integers(1, 9), n=st.integers(1, 300), k=st.integers(1, 140), batch=st.integers(1, 3),
       ta=st.booleans(), tb=st.booleans(), seed=st.integers(0, 2**16))
def test_small_products_match_numpy(portable, m, n, k, batch, ta, tb, seed):
    """Every operand layout MLX hands to cblas_sgemm (strided batches, transposed views)."""
    with kernels(portable):
        _small_product(m, n, k, batch, ta, tb, seed)


def _small_product(m, n, k, batch, ta, tb, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, k, m) if ta else (batch, m, k)).astype(np.float32)
    b = rng.standard_normal((batch, n, k) if tb else (batch, k, n)).astype(np.float32)
    ma, mb = mx.array(a), mx.array(b)
    got = np.array(mx.matmul(ma.swapaxes(-1, -2) if ta else ma, mb.swapaxes(-1, -2) if tb else mb))
    a64 = a.astype(np.float64).swapaxes(-1, -2) if ta else a.astype(np.float64)
    b64 = b.astype(np.float64).swapaxes(-1, -2) if tb else b.astype(np.float64)
    want = a64 @ b64
    scale = np.abs(a64) @ np.abs(b64) + 1e-30
    assert got.shape == want.shape
    assert float((np.abs(got - want) / scale).max()) < 1e-5


@needs_shim
@kernel_sets
@given(g=st.integers(1, 8), d=st.sampled_from([16, 64, 128]), live=st.integers(1, 150), pad=st.integers(1, 100),
       seed=st.integers(0, 2**16))
def test_small_products_do_not_depend_on_padding(portable, g, d, live, pad, seed):
    """A decode step's attention products over a padded span give bit-identical live entries:
    scores of live keys do not change with more columns, and zero weights on padded
    rows of V add nothing.  (This is what lets a slot's answer ignore its neighbours.)
    Sizes stay under the shim's small-product bound (g * d * span <= 2^18)."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((g, d)).astype(np.float32))
    keys = mx.array(rng.standard_normal((live + pad, d)).astype(np.float32))
    with kernels(portable):
        short, long = q @ keys[:live].T, q @ keys.T
        assert np.array_equal(np.array(short), np.array(long[:, :live]))
        p = mx.softmax(short, axis=-1)
        padded = mx.concatenate([p, mx.zeros((g, pad))], axis=1)
        assert np.array_equal(np.array(p @ keys[:live]), np.array(padded @ keys))


@needs_shim
@kernel_sets
@given(m=st.integers(2, 64), n=st.integers(1, 700), k=st.sampled_from([64, 200, 1024]), seed=st.integers(0, 2**16),
       data=st.data())
def test_weight_products_match_numpy_and_ignore_other_rows(portable, m, n, k, seed, data):
    """[rows, k] @ W.T with W stored [n, k] (a linear layer): 2..64 rows go through the
    shim's threaded loops.  Right to float tolerance, and each row's result is bit-identical
    whichever other rows share the call -- a slot's logits do not depend on its neighbours.
    (Calls of 8 rows or more take the outer form, fewer the dot form: the identity holds
    between calls of the same form, which a decode step's fixed row count always is.)"""
    with kernels(portable):
        _weight_product(m, n, k, seed, data)


def _weight_product(m, n, k, seed, data):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    mw = mx.array(w)
    got = np.array(mx.array(x) @ mw.T)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert float((np.abs(got - want) / (np.abs(x) @ np.abs(w).T)).max()) < 1e-5
    size = data.draw(st.integers(8, m) if m >= 8 else st.integers(2, m), label="rows in the sub-call")
    r = data.draw(st.integers(0, m - size), label="first row")
    sub = np.array(mx.array(x[r:r + size]) @ mw.T)
    assert np.array_equal(sub, got[r:r + size])


_FORK = """
import ctypes, json, os, signal, sys
import numpy as np
import slotinfer
from slotinfer.cpu import blas
shim = ctypes.CDLL(blas.shim_path())  # the object already serving MLX
shim.cblas_sgemm.restype = None
m, n, k = 16, 512, 1024  # a linear layer's product: the shim's threaded loops
rng = np.random.default_rng(0)
x = rng.standard_normal((m, k)).astype(np.float32)
w = rng.standard_normal((n, k)).astype(np.float32)
def product():
    c = np.full((m, n), np.nan, dtype=np.float32)
    f = ctypes.POINTER(ctypes.c_float)
    shim.cblas_sgemm(101, 111, 112, m, n, k, ctypes.c_float(1.0), x.ctypes.data_as(f), k,
                     w.ctypes.data_as(f), k, ctypes.c_float(0.0), c.ctypes.data_as(f), n)
    return c
before = product()  # starts the pool's workers
pid = os.fork()
if pid == 0:  # the workers did not come along: the child must start its own, not wait on them
    signal.alarm(60)
    os._exit(0 if all(np.array_equal(product(), before) for _ in range(3)) else 1)
_, status = os.waitpid(pid, 0)
want = x.astype(np.float64) @ w.astype(np.float64).T
print(json.dumps({"child": os.waitstatus_to_exitcode(status), "parent_again": bool(np.array_equal(product(), before)),
                  "close": bool(np.abs(before - want).max() < 1e-3), "note": slotinfer.BLAS.note}))
"""


@needs_shim
@pytest.mark.parametrize("threads", ["1", "2"])
def test_shim_products_survive_fork(threads):
    """A process that forks after the shim's thread pool has started (a DataLoader, a
    multiprocessing worker) gets the same products in the child, which starts its own
    workers, and in the parent, whose workers go on."""
    got = _py(_FORK, SLOTINFER_BLAS_THREADS=threads)
    assert "shim" in got["note"]
    assert got == {**got, "child": 0, "parent_again": True, "close": True}


def test_import_writes_no_file(tmp_path):
    """Importing slotinfer and loading its BLAS compiles nothing and writes nothing: the shim is
    built at install time, and no cache folder appears in the user's home."""
    home = tmp_path / "home"
    home.mkdir()
    out = _py("import json, slotinfer; print(json.dumps({'note': slotinfer.BLAS.note}))",
              HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), CC=str(tmp_path / "no-compiler"))
    assert "note" in out
    assert list(home.rglob("*")) == []
