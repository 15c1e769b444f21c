"""Elementwise math for the CPU device policy.

MLX's x86 CPU build evaluates ``exp`` one element at a time, each polynomial step a call
into libm's ``fmaf``, which makes exp the largest single cost of a prefill (softmax over
L x L scores) and of a decode step's MLP activation.  :func:`exp` below is the same
function written as MLX arithmetic -- Cody-Waite range reduction by ln 2, the degree-6
polynomial of the Cephes ``expf``, and 2^n built in the exponent bits -- which compiles
into fused kernels without calls, several times faster, with a relative error under 1e-7
(``mx.exp`` here: 4e-6; docs/notes/benchmarks-history.md has the measurements).  Inputs below -86.99 give exactly 0 (so masked scores
drop out exactly); inputs above 88 are clamped; NaN stays NaN.

GPU kernels have a fast ``exp`` of their own; :mod:`slotinfer.device` decides which is used.
"""

from __future__ import annotations

import mlx.core as mx

_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 = hi + lo, hi exact in a few bits
_ROUND = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds a float to an integer
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def exp(x: mx.array, *, estrin: bool = True) -> mx.array:
    """``e ** x`` for float32 ``x`` (see the module docstring).

    Written for MLX's fusion, where each kernel is a full pass over memory and a value used
    twice ends one: inputs whose 2^n would be 2^-126 or less (x below -86.99) get 0 exponent
    bits, which are +0.0, instead of a last ``where`` on ``x``.  The polynomial is in
    Estrin's form (depth 4) or Horner's (depth 12); they round alike but MLX splits them into
    kernels differently, and which is faster depends on the graph around them: Estrin's in a
    softmax, Horner's in the MLP's activation.
    """
    c = mx.clip(x, -87.0, 88.0)
    n = (c * _LOG2E + _ROUND) - _ROUND
    r = (c - n * _LN2_HI) - n * _LN2_LO
    two_n = mx.view(mx.where(n < -125.5, 0, (n.astype(mx.int32) + 127) << 23), mx.float32)
    if estrin:
        r2 = r * r
        p = ((_P[0] * r + _P[1]) * r2 + (_P[2] * r + _P[3])) * r2 + (_P[4] * r + _P[5])
        return (p * r2 + r + 1.0) * two_n
    p = _P[0]
    for coef in _P[1:]:
        p = p * r + coef
    return (p * (r * r) + r + 1.0) * two_n


def sigmoid(x: mx.array) -> mx.array:
    return 1.0 / (1.0 + exp(-x, estrin=False))


def silu(x: mx.array) -> mx.array:
    return x / (1.0 + exp(-x, estrin=False))


def shifted_exp(x: mx.array) -> mx.array:
    """``exp(x - max(x))`` over the last axis: softmax before its division."""
    return exp(x - mx.max(x, axis=-1, keepdims=True))


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis; rows whose entries are all ``-inf`` are not expected."""
    e = shifted_exp(x)
    return e / mx.sum(e, axis=-1, keepdims=True)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis, as MLX's CPU fallback computes it.

    In a compiled graph MLX fuses the per-row ``rsqrt`` into the kernel that scales ``x``,
    which then evaluates it once per *element* (a scalar square root and division each),
    the costliest elementwise kernel of a decode step.  Passing the per-row scale through
    ``view`` ends a kernel there (see :func:`exp`), so it is computed once per row and the
    scaling kernel only multiplies, with the same result bit for bit.  Other dtypes than float32 (which MLX normalizes in float32) go to
    ``mx.fast.rms_norm``.
    """
    if x.dtype != mx.float32:
        return mx.fast.rms_norm(x, weight, eps)
    scale = mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)
    scale = mx.view(mx.view(scale, mx.int32), mx.float32)
    y = x * scale
    return y if weight is None else y * weight
