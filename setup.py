"""Build-time extras that pyproject.toml cannot express: the optional BLAS shim.

slotinfer/_blas_shim.c is a plain shared object (no Python API) exporting
cblas_sgemm/dgemm/cgemm for MLX and forwarding them to the prefixed
scipy-openblas32 / numpy-bundled OpenBLAS (see slotinfer/_blas.py).  It is
optional: without a C compiler the install still succeeds, and slotinfer then
compiles the shim on first use if `cc` appears later, or falls back to another
BLAS.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform == "linux":
    ext_modules.append(Extension("slotinfer._blas_shim", ["slotinfer/_blas_shim.c"],
                                 depends=["slotinfer/_blas_kernels.h"], libraries=["dl", "pthread"],
                                 extra_compile_args=["-O3", "-pthread"], optional=True))

setup(ext_modules=ext_modules)
