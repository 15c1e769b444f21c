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

import logging
import sys
import warnings

from setuptools import Extension, setup

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

setup(ext_modules=ext_modules)
