"""Give MLX an optimized BLAS on Linux CPU.

The ``mlx[cpu]`` Linux wheel links a bundled reference BLAS, and its f32
matmul (every Linear layer) goes through ``cblas_sgemm``.  A library exporting
that symbol, loaded with ``RTLD_GLOBAL`` before ``mlx.core`` is imported, wins
symbol resolution and makes those matmuls fast.  Loading it after the import
does not help, hence ``slotinfer/__init__`` calls :func:`ensure_blas` first.

``SLOTINFER_BLAS`` picks the library: ``none``, ``openblas-scipy``,
``openblas-numpy``, ``openblas-system``, ``mkl`` or an absolute path to a
library exporting ``cblas_sgemm``; unset means the fastest available, in the
order of :data:`AUTO_ORDER` (``docs/blas.md`` says why).  OpenBLAS goes through
a small C shim (``_blas_shim.c``): the PyPI builds export only prefixed symbols,
the shim sends one-row products to gemv, and it computes small products itself
(its batch-invariance contract is in ``docs/blas.md``).  The shim is built when
slotinfer is installed (``setup.py``); importing slotinfer never compiles
anything nor writes a file.  ``SLOTINFER_BLAS_THREADS`` sets the thread count
(default: usable physical cores).

Why one module: finding a BLAS, loading it before MLX and reporting what loaded are one
decision, made once at import.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass

from .. import settings

AUTO_ORDER = ("openblas-scipy", "openblas-numpy", "openblas-system", "mkl")
_HERE = os.path.dirname(os.path.abspath(__file__))
_HOWTO = ("`pip install scipy-openblas32` and reinstall slotinfer with a C compiler at hand "
          "(its shim is built at install time), or `apt-get install libopenblas0-pthread`")


@dataclass(frozen=True)
class BlasInfo:
    name: str                  # "openblas-scipy", ..., "reference", "accelerate"
    path: str | None           # the library that now provides cblas_sgemm
    optimized: bool
    version: str | None = None
    threads: int | None = None
    note: str | None = None


_info: BlasInfo | None = None
_shim = None  # the shim's handle, when the BLAS is reached through it


def ensure_blas() -> BlasInfo:
    """Load the best BLAS once per process; never raises."""
    global _info
    if _info is None:
        try:
            _info = _choose()
        except Exception as e:  # noqa: BLE001 - `import slotinfer` must not fail here
            _info = _reference(f"BLAS setup failed ({e!r})")
    return _info


def _reference(why: str, fix: str | None = None) -> BlasInfo:
    """The reference BLAS stays, with one warning that says why and what fixes it (by default,
    installing an optimized BLAS; ``fix`` when the library is there and something else is wrong)."""
    try:  # under `-W error` too, importing slotinfer must not raise
        warnings.warn(f"slotinfer: {why}; MLX keeps its reference BLAS, so f32 matmul on CPU "
                      f"is much slower. {fix or 'For an optimized one: ' + _HOWTO}.", stacklevel=4)
    except Exception:  # noqa: BLE001
        pass
    return BlasInfo("reference", None, False, note=why)


def _choose() -> BlasInfo:
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, True, note="MLX uses Accelerate / Metal on macOS")
    if sys.platform != "linux":
        return BlasInfo("mlx-default", None, False, note=f"nothing to do on {sys.platform}")
    pre = _global_provider()
    if pre is not None:  # LD_PRELOAD or an earlier RTLD_GLOBAL load: it wins regardless
        fast = any(k in pre.lower() for k in ("openblas", "mkl", "blis", "blas_shim"))
        return _finish(BlasInfo("preloaded", pre, fast, note="cblas_sgemm was already global"))
    if "mlx.core" in sys.modules:
        # The optimized BLAS may well be installed: the fix is the import order, not a package.
        return _reference("mlx.core was imported before slotinfer, too late to swap its BLAS",
                          "To fix it, import slotinfer first: `import slotinfer` before `import mlx.core` "
                          "or any package that imports MLX (such as mlx_lm)")
    # OpenBLAS workers spin before sleeping; when another thread or process wants the
    # core (our own host bookkeeping, a producer thread), long spins stall every call.
    # A short timeout (2**4 cycles) costs nothing on an idle machine.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    want = settings.blas()
    if want.lower() == "none":
        return _reference("SLOTINFER_BLAS=none")
    if want:
        key = want if os.path.isabs(want) else want.lower()
        if not os.path.isabs(key) and key not in _LOADERS:
            return _reference(f"SLOTINFER_BLAS={want!r} is not one of none, "
                              f"{', '.join(AUTO_ORDER)} or an absolute path")
        info, why = _load_direct("custom", key) if os.path.isabs(key) else _LOADERS[key]()
        return _finish(info) if info else _reference(f"SLOTINFER_BLAS={want}: {why}")
    whys = []
    for key in AUTO_ORDER:
        info, why = _LOADERS[key]()
        if info:
            if whys:
                info = dataclasses.replace(info, note=_join(info.note, "skipped " + "; ".join(whys)))
            return _finish(info)
        whys.append(f"{key}: {why}")
    return _reference("no optimized BLAS found (" + "; ".join(whys) + ")")


# -- candidates: each returns (BlasInfo, None) once globally loaded, or (None, why)

def _openblas_scipy():
    spec = importlib.util.find_spec("scipy_openblas32")
    libs = _glob(spec and spec.submodule_search_locations, "lib/libscipy_openblas*.so")
    if not libs:
        return None, "scipy-openblas32 not installed"
    return _load_via_shim("openblas-scipy", libs[0], "scipy_", "", 0)


def _openblas_numpy():
    # numpy's Linux wheels bundle an ILP64 OpenBLAS (numpy.libs/libscipy_openblas64_*)
    spec = importlib.util.find_spec("numpy")
    locs = spec and spec.submodule_search_locations
    libs = _glob([os.path.dirname(p) for p in locs or ()], "numpy.libs/libscipy_openblas64_*.so")
    if not libs:
        return None, "numpy has no bundled OpenBLAS"
    return _load_via_shim("openblas-numpy", libs[0], "scipy_", "64_", 1)


def _openblas_system():
    import ctypes.util
    names = ["libopenblas.so.0", "libopenblasp.so.0", "libopenblaso.so.0"]
    for d in ("/usr/lib/x86_64-linux-gnu/openblas-pthread", "/usr/lib/aarch64-linux-gnu/openblas-pthread",
              "/usr/lib64", "/usr/lib", "/usr/local/lib", "/opt/OpenBLAS/lib"):
        names.append(os.path.join(d, "libopenblas.so.0"))
    names.append(ctypes.util.find_library("openblas"))
    for name in filter(None, names):
        try:
            path = _path_of(ctypes.CDLL(name, mode=ctypes.RTLD_LOCAL).cblas_sgemm) or name
        except (OSError, AttributeError):
            continue
        # Through the shim too when it is at hand, for its one-row gemv routing.
        info, _ = _load_via_shim("openblas-system", path, "", "", 0)
        return (info, None) if info else _load_direct("openblas-system", path)
    return None, "no libopenblas.so.0 found"


def _mkl():
    libs = _glob([os.path.join(sys.prefix, "lib")], "libmkl_rt.so*") + ["libmkl_rt.so.2", "libmkl_rt.so.3"]
    for name in libs:
        info, _ = _load_direct("mkl", name)
        if info:
            return info, None
    return None, "MKL (pip install mkl) not found"


_LOADERS = {"openblas-scipy": _openblas_scipy, "openblas-numpy": _openblas_numpy,
            "openblas-system": _openblas_system, "mkl": _mkl}


# -- loading ----------------------------------------------------------------

def _glob(dirs, pattern):
    return sorted(p for d in dirs or () for p in glob.glob(os.path.join(d, pattern)))


def _load_direct(name, lib):
    try:
        h = ctypes.CDLL(lib, mode=ctypes.RTLD_LOCAL)
        sgemm = h.cblas_sgemm
    except (OSError, AttributeError) as e:
        return None, str(e)
    if not _sgemm_works(sgemm):
        return None, f"{lib}: cblas_sgemm gives wrong results"
    path = _path_of(sgemm) or lib
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)  # same object, promoted to the global scope
    return BlasInfo(name, path, True), None


def _load_via_shim(name, lib, prefix, suffix, ilp64):
    shim = shim_path()
    if shim is None:
        return None, "its C shim was not built when slotinfer was installed (no C compiler then?)"
    h = ctypes.CDLL(shim, mode=ctypes.RTLD_LOCAL)
    # Resolve targets while the shim is still local: MLX must never see null pointers.
    if h.slotinfer_shim_init(lib.encode(), prefix.encode(), suffix.encode(), ilp64) != 0:
        return None, f"{lib} lacks {prefix}cblas_sgemm{suffix}"
    h.slotinfer_shim_own(0)  # first the library alone, then with the shim's own loops
    if not _sgemm_works(h.cblas_sgemm):
        return None, f"{lib} via shim gives wrong results"
    h.slotinfer_shim_own(1)
    if not _sgemm_works(h.cblas_sgemm):
        return None, f"the shim's own loops give wrong results with {lib}"
    h.slotinfer_shim_own(int(settings.own_gemm()))  # off: every product to the library
    global _shim
    _shim = h
    ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    return BlasInfo(name, lib, True, note=f"via shim {shim}"), None


def set_own_products(on: bool) -> bool:
    """Turn the shim's own loops (small products, 2..64-row products against a stored
    weight) on or off, leaving every product to the library; returns the previous
    setting.  For measuring what they add (benchmarks/bench_engine.py gives mlx-lm
    the plain library).  A no-op returning False when the BLAS is not reached via the shim."""
    return _shim is not None and bool(_shim.slotinfer_shim_own(int(on)))


def use_portable_kernels(on: bool) -> bool:
    """Run the shim's own loops on their portable kernels (plain C vectors, any CPU) instead
    of the AVX2+FMA ones the CPU may have; returns whether the portable ones now run.  For
    the tests, which hold both to the same properties.  False when the BLAS is not reached
    via the shim."""
    return _shim is not None and not _shim.slotinfer_shim_kernels(int(not on))


def _sgemm_works(sgemm) -> bool:
    """Small products through every path of the shim (gemm, one-row and one-column
    gemv, column-major, its own vector loops), output prefilled with NaN since beta=0 must overwrite it.
    Catches a wrong ABI (e.g. an ILP64 library) or a bad forward before MLX sees it."""
    sgemm.restype = None
    for order, ta, tb, m, n, k in [(101, 111, 112, 2, 3, 4), (101, 111, 112, 1, 3, 4), (101, 112, 111, 1, 3, 4),
                                   (101, 111, 111, 3, 1, 4), (101, 112, 112, 3, 1, 4), (102, 111, 112, 1, 3, 4),
                                   (101, 111, 112, 3, 5, 37), (101, 111, 111, 2, 270, 19)]:
        x = [[i * k + j + 1.0 for j in range(k)] for i in range(m)]       # op(A), m x k
        y = [[(i + 2 * j) % 5 - 2.0 for j in range(n)] for i in range(k)]  # op(B), k x n
        want = [[sum(x[i][p] * y[p][j] for p in range(k)) for j in range(n)] for i in range(m)]
        a, lda = _store(x, ta != 111, order)
        b, ldb = _store(y, tb != 111, order)
        c, ldc = _store([[float("nan")] * n for _ in range(m)], False, order)
        sgemm(order, ta, tb, m, n, k, ctypes.c_float(1.0), a, lda, b, ldb, ctypes.c_float(0.0), c, ldc)
        got = [[c[i * ldc + j] if order == 101 else c[j * ldc + i] for j in range(n)] for i in range(m)]
        if got != want:
            return False
    return True


def _store(mat, transposed, order):
    """mat as a CBLAS operand (buffer, leading dimension): transposed or not, row- (101)
    or column-major, with one padding element per line so strides are exercised."""
    if transposed:
        mat = [list(r) for r in zip(*mat)]
    if order != 101:
        mat = [list(r) for r in zip(*mat)]
    ld = len(mat[0]) + 1
    return (ctypes.c_float * (len(mat) * ld))(*[v for r in mat for v in r + [-7.0]]), ld


def shim_path() -> str | None:
    """The shim that ``setup.py`` built next to this file at install time, or None."""
    built = sorted(glob.glob(os.path.join(_HERE, "_blas_shim*.so")))
    return built[0] if built else None


# -- introspection ----------------------------------------------------------

class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


def _path_of(fn) -> str | None:
    info = _DlInfo()
    if ctypes.CDLL(None).dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) and info.fname:
        return os.path.realpath(info.fname.decode())
    return None


def _global_provider() -> str | None:
    try:
        return _path_of(ctypes.CDLL(None).cblas_sgemm)  # what libmlx would bind to
    except AttributeError:
        return None


def usable_cores() -> int:
    """Physical cores this process may run on: its affinity mask, SMT siblings
    counted once, capped by a cgroup v2 CPU quota (containers)."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as fh:
                cores.add(fh.read().strip())
        except OSError:
            cores = cpus
            break
    n = len(cores)
    try:
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            n = min(n, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _threads(library_vars) -> int | None:
    """SLOTINFER_BLAS_THREADS, else None where the library already read its own
    variable at load, else one thread per usable physical core (see docs/blas.md
    for what this costs on a busy machine)."""
    if n := settings.blas_threads():
        return n
    if any(v in os.environ for v in library_vars):
        return None
    return usable_cores()


def _finish(info: BlasInfo) -> BlasInfo:
    """Fill in version and thread count."""
    try:
        info = dataclasses.replace(info, **_tune(info))
        if _shim is not None and info.threads:  # the shim's own products use as many threads
            _shim.slotinfer_shim_threads(info.threads)
        return info
    except Exception as e:  # noqa: BLE001 - the library is loaded and serving MLX regardless
        return dataclasses.replace(info, note=_join(info.note, f"introspection failed: {e!r}"))


def _tune(info: BlasInfo) -> dict:
    lib = ctypes.CDLL(info.path)  # loaded already: the same object
    pre, suf = {"openblas-scipy": ("scipy_", ""), "openblas-numpy": ("scipy_", "64_")}.get(info.name, ("", ""))
    get_config = getattr(lib, f"{pre}openblas_get_config{suf}", None)
    if get_config is not None:
        get_config.restype = ctypes.c_char_p
        # OpenBLAS starts one thread per logical CPU, ignoring SMT and cgroup quotas.
        if n := _threads(("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")):
            getattr(lib, f"{pre}openblas_set_num_threads{suf}")(n)
        return {"version": get_config().decode(), "threads": getattr(lib, f"{pre}openblas_get_num_threads{suf}")()}
    if hasattr(lib, "MKL_Get_Version_String"):
        if n := _threads(("MKL_NUM_THREADS", "OMP_NUM_THREADS")):
            lib.MKL_Set_Num_Threads(n)
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, 256)
        return {"version": buf.value.decode().strip(), "threads": lib.MKL_Get_Max_Threads()}
    return {}


def _join(*parts) -> str:
    return "; ".join(p for p in parts if p)
