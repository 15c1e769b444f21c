"""Build-time extras that pyproject.toml cannot express: the optional BLAS shim.

slotinfer/cpu/_blas_shim.c is a plain shared object (no Python API) exporting
cblas_sgemm/dgemm/cgemm for MLX and forwarding them to the prefixed
scipy-openblas32 / numpy-bundled OpenBLAS (see slotinfer/cpu/blas.py).  It is
built here, at install time, and only here: importing slotinfer never compiles
anything.  It is optional: without a C compiler the install still succeeds, and
slotinfer falls back to a BLAS that needs no shim (system OpenBLAS, MKL) or to
MLX's reference BLAS, with a warning that says how to get the fast one.  After
editing the C source in a checkout, rebuild it with
`python setup.py build_ext --inplace`.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform == "linux":
    ext_modules.append(Extension("slotinfer.cpu._blas_shim", ["slotinfer/cpu/_blas_shim.c"],
                                 depends=["slotinfer/cpu/_blas_kernels.h"], libraries=["dl", "pthread"],
                                 extra_compile_args=["-O3", "-pthread"], optional=True))

setup(ext_modules=ext_modules)
