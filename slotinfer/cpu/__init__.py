"""The CPU performance layer: everything slotinfer does to make MLX fast on a CPU.

* :mod:`.blas` -- loads an optimized BLAS for MLX's f32 matmul before ``mlx.core`` is
  imported (``slotinfer/__init__`` calls it first), through the C shim
  ``_blas_shim.c`` (built at install time by ``setup.py``) for PyPI's OpenBLAS builds.
* :mod:`.allocator` -- keeps freed activations in the process (glibc), and gives back what an
  outsized request took.
* :mod:`.fastmath` -- exp, softmax and RMSNorm written as fused MLX arithmetic.
* :mod:`.ops` -- the one ops object the model computes with.

:mod:`slotinfer.device` decides per device which of these apply; the environment
variables that override them are read in :mod:`slotinfer.settings`.  This package
imports nothing on its own, so ``from slotinfer.cpu import blas`` runs before MLX.
"""
