"""Build-time extras that pyproject.toml cannot express: two optional native parts.

1. The BLAS shim.
slotinfer/cpu/_blas_shim.c is a plain shared object (no Python API) exporting
cblas_sgemm/dgemm/cgemm for MLX and forwarding them to the prefixed
scipy-openblas32 / numpy-bundled OpenBLAS (see slotinfer/cpu/blas.py).  It is
built here, at install time, and only here: importing slotinfer never compiles
anything.  It is optional: without a C compiler the install still succeeds, and
slotinfer falls back to a BLAS that needs no shim (system OpenBLAS, MKL) or to
MLX's reference BLAS, with a warning that says how to get the fast one.  After
editing the C source in a checkout, rebuild it with
`python setup.py build_ext --inplace`.

2. The quantized-linear kernels (slotinfer/cpu/qkernel/): an MLX extension (a custom primitive,
C++20, bound with nanobind) computing linear layers on GGUF Q4_0/Q4_1/Q8_0/Q5_0/Q4_K/Q6_K blocks on CPU.  It
is compiled against the mlx wheel and nanobind of the build environment (pyproject.toml's
build-system requires both on Linux); the mlx version it was built against is compiled in, and
slotinfer uses it only under that same version.  Optional too: where it cannot be built,
slotinfer computes those layers in float32 as before, and `slotinfer info` says why
(docs/quantized-cpu.md).
"""

import logging
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# `pip install -e .` (the install README gives) would print setuptools' notices about editable
# installs in a box: that a path finder is used, and to mind folders named like the package.  Both
# describe a checkout working as intended; errors and real warnings still show.
logging.getLogger("setuptools.command.editable_wheel").setLevel(logging.ERROR)
try:
    from setuptools.warnings import InformationOnly
    warnings.filterwarnings("ignore", category=InformationOnly)
except ImportError:  # an older setuptools, without these notices
    pass

ext_modules = []
if sys.platform == "linux":
    # -Wno-psabi: GCC's note that the AVX kernels' ABI changed in GCC 4.6 concerns no caller here
    ext_modules.append(Extension("slotinfer.cpu._blas_shim", ["slotinfer/cpu/_blas_shim.c"],
                                 depends=["slotinfer/cpu/_blas_kernels.h"], libraries=["dl", "pthread"],
                                 extra_compile_args=["-O3", "-pthread", "-Wno-psabi"], optional=True))

QKERNEL = "slotinfer.cpu.qkernel._qkernel"
QKERNEL_DIR = os.path.join("slotinfer", "cpu", "qkernel")
if sys.platform == "linux":
    # sources, include dirs and the mlx library are filled in by BuildExt once mlx and nanobind import
    # module.cpp: the nanobind module; primitives.cpp: the MLX primitives (kv_write.cpp: the K/V writes); the headers: the thread
    # pool (pool.h), the primitives' base (rowwise.h) and the loops (kernels.h and what it includes)
    QKERNEL_SOURCES = [os.path.join(QKERNEL_DIR, f) for f in ("module.cpp", "primitives.cpp",
                                                                   "kv_write.cpp", "prefill_attention.cpp")]
    QKERNEL_HEADERS = [os.path.join(QKERNEL_DIR, f) for f in ("attend_simd.h", "decode_ops.h", "kernels.h", "kernels_i8.h", "loops.h", "loops_i8.h", "pool.h",
                                                               "prefill_attention.h", "prefill_loops.h", "primitives.h",
                                                               "qkernels.h", "rowwise.h", "simd.h")]
    ext_modules.append(Extension(QKERNEL, list(QKERNEL_SOURCES), language="c++", depends=QKERNEL_HEADERS,
                                 optional=True))


def compile_in_parallel(compiler):
    """Makes `compiler.compile` compile its sources side by side, one per core: distutils compiles an
    extension's sources one after another (primitives.cpp alone takes most of a build's time)."""
    serial = compiler.compile

    def compile(sources, *args, **kwargs):
        if len(sources) < 2 or (os.cpu_count() or 1) < 2:
            return serial(sources, *args, **kwargs)
        with ThreadPoolExecutor(min(len(sources), os.cpu_count())) as pool:
            parts = list(pool.map(lambda source: serial([source], *args, **kwargs), sources))
        return [obj for objects in parts for obj in objects]

    compiler.compile = compile


class BuildExt(build_ext):
    """Completes the qkernel extension from the build environment's mlx and nanobind; a missing
    piece makes it skip with a note, as a failed compile does (the extensions are optional)."""

    def build_extension(self, ext):
        if ext.name != QKERNEL:
            return super().build_extension(ext)
        try:
            import mlx.core as mx
            import nanobind
        except ImportError as e:
            self.warn(f"slotinfer: the quantized-linear kernels are not built ({e}); "
                      "CPU linear layers on quantized weights stay float32")
            return None
        mlx_dir = os.path.dirname(mx.__file__)  # site-packages/mlx: include/ and lib/libmlx.so
        nb_dir = os.path.dirname(nanobind.__file__)
        ext.sources = QKERNEL_SOURCES + [os.path.join(nb_dir, "src", "nb_combined.cpp")]
        ext.include_dirs += [os.path.join(nb_dir, "include"), os.path.join(nb_dir, "ext", "robin_map", "include"),
                             os.path.join(mlx_dir, "include")]
        ext.library_dirs += [os.path.join(mlx_dir, "lib")]
        ext.libraries += ["mlx"]
        # NB_DOMAIN mlx: share mlx.core's registered types (mx.array, streams) with this module.
        # -g0: no debug information (the link strips it anyway: the module is the same bytes, built faster).
        # -ffp-contract=off: the loops' multiply-adds are the explicit ones (the sum order is a contract).
        # QK_MLX_VERSION: slotinfer uses the module only under the mlx it was compiled against
        ext.define_macros += [("NB_DOMAIN", "mlx"), ("NB_COMPACT_ASSERTIONS", None), ("NDEBUG", None),
                              ("QK_MLX_VERSION", f'"{mx.__version__}"')]
        ext.extra_compile_args += ["-std=c++20", "-O3", "-fvisibility=hidden", "-fno-strict-aliasing",
                                   "-ffp-contract=off", "-Wno-psabi", "-g0",
                                   "-Wno-uninitialized", "-Wno-maybe-uninitialized"]  # GCC on its own AVX-512 headers
        ext.extra_link_args += ["-Wl,--gc-sections", "-s", "-pthread"]
        compile_in_parallel(self.compiler)
        return super().build_extension(ext)


setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
