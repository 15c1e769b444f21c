// The loops of loops.h compiled once per instruction set, and the functions the primitives call,
// each running the loops of the instruction set qk::isa() names.  A new instruction set is a traits
// type in simd.h, one inclusion here and one case in on_isa (plus its name in qkernels.h's Isa).
#pragma once

#include "decode_ops.h"
#include "kernels_i8.h"
#include "qkernels.h"
#include "simd.h"

namespace qk {

template <class I>
struct Kernels;

#define QK_ISA Portable
#define QK_TARGET QK_PORTABLE_TARGET
#include "loops.h"
#undef QK_ISA
#undef QK_TARGET

#ifdef QK_X86
#define QK_ISA Avx2
#define QK_TARGET QK_AVX2_TARGET
#include "loops.h"
#undef QK_ISA
#undef QK_TARGET

#define QK_ISA Avx512
#define QK_TARGET QK_AVX512_TARGET
#include "loops.h"
#undef QK_ISA
#undef QK_TARGET
#endif

// fn(Kernels<the instruction set in use>{})
template <class Fn>
inline void on_isa(Fn&& fn) {
  switch (isa()) {
#ifdef QK_X86
    case Isa::Avx512: return fn(Kernels<Avx512>{});
    case Isa::Avx2: return fn(Kernels<Avx2>{});
#endif
    default: return fn(Kernels<Portable>{});
  }
}

// One thread's share of a product, rows in chunks of ROW_CHUNK so a chunk of x stays in the L2 cache.
inline void columns(const Job& job, std::vector<float>& buf) {
  if (int8_activations()) return columns_i8(job);  // the option: 8-bit activations (kernels_i8.h)
  for (int r0 = 0; r0 < job.m; r0 += ROW_CHUNK) {
    Job part = job;
    part.x = job.x + (size_t)r0 * job.k;
    part.out = job.out + (size_t)r0 * job.n;
    part.m = std::min(ROW_CHUNK, job.m - r0);
    on_isa([&](auto k) { k.columns(part, buf); });
  }
}

// Units [u0, u1) of an attention job whose K/V heads' query heads go in `split` parts (decode_ops.h)
inline void attend_units(const AttendJob& j, int split, int u0, int u1) {
  on_isa([&](auto k) { k.attend_units(j, split, u0, u1); });
}

inline void attend_rows(const AttendJob& j, int b0, int b1) { attend_units(j, 1, b0 * j.kvh, b1 * j.kvh); }

inline void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int n, float eps) {
  on_isa([&](auto k) { k.rms_norm_rows(x, w, y, rows, n, eps); });
}

inline void gated_rows(const float* gu, float* y, int64_t rows, int n, int gelu) {
  on_isa([&](auto k) { k.gated_rows(gu, y, rows, n, gelu); });
}

inline void rope_rows(const float* x, const float* cs, const float* sn, float* y, int B, int H, int D, int half,
                      bool per_row) {
  on_isa([&](auto k) { k.rope_rows(x, cs, sn, y, B, H, D, half, per_row); });
}

}  // namespace qk
