// The instruction sets the loops are written against, one traits type each:
//   V        the accumulator / weight register, W float32 lanes
//   ROWS     how many rows of x a product takes straight from the decoded registers (more rows
//            go through the decoded panel); PANEL: the columns a panel holds
//   zero, load, store, fma (acc + a * b, rounded once where the ISA has a fused multiply-add),
//   reduce (the lanes to one float in a fixed tree), decode<F> (a block to 32 / W registers).
// loops.h is written once against these names.  Portable is the reference: its decode is
// decode_portable, and each vector decoder gives exactly its weights.
#pragma once

#include "qkernels.h"

namespace qk {

#define QK_PORTABLE_TARGET
#define QK_INL inline __attribute__((always_inline))

// 8 lanes in plain C++: the lanes' multiply and add each rounded (no fused multiply-add).
struct Portable {
  static constexpr int W = 8, ROWS = 1, PANEL = 2;
  struct V {
    float l[8];
  };
  static QK_INL V zero() { return V{}; }
  static QK_INL V load(const float* p) {
    V v;
    for (int i = 0; i < 8; ++i) v.l[i] = p[i];
    return v;
  }
  static QK_INL void store(float* p, V v) {
    for (int i = 0; i < 8; ++i) p[i] = v.l[i];
  }
  static QK_INL V fma(V a, V b, V acc) {
    for (int i = 0; i < 8; ++i) acc.l[i] += a.l[i] * b.l[i];
    return acc;
  }
  static QK_INL float reduce(V v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
    float s0 = v.l[0] + v.l[4], s1 = v.l[1] + v.l[5], s2 = v.l[2] + v.l[6], s3 = v.l[3] + v.l[7];
    return (s0 + s2) + (s1 + s3);
  }
  template <Format F>
  static QK_INL void decode(const uint8_t* blk, V* w) {
    float t[BLOCK];
    decode_portable(F, blk, t);
    for (int s = 0; s < BLOCK / W; ++s) w[s] = load(t + W * s);
  }
};

#ifdef QK_X86
#define QK_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define QK_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

QK_AVX2_TARGET QK_INL float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

QK_AVX2_TARGET QK_INL float reduce128(__m128 s) {  // ((l0+l2)+(l1+l3)) of 4 lanes
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

struct Avx2 {
  static constexpr int W = 8, ROWS = 1, PANEL = 2;
  using V = __m256;
  static QK_AVX2_TARGET QK_INL V zero() { return _mm256_setzero_ps(); }
  static QK_AVX2_TARGET QK_INL V load(const float* p) { return _mm256_loadu_ps(p); }
  static QK_AVX2_TARGET QK_INL void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static QK_AVX2_TARGET QK_INL V fma(V a, V b, V acc) { return _mm256_fmadd_ps(a, b, acc); }
  static QK_AVX2_TARGET QK_INL float reduce(V v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
    return reduce128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
  }
  template <Format F>
  static QK_AVX2_TARGET QK_INL void decode(const uint8_t* blk, V* w) {
    const __m256 d = _mm256_set1_ps(load_half(blk));
    if constexpr (F == Format::Q8_0) {
      for (int s = 0; s < 4; ++s) {
        __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * s));
        w[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
      }
    } else {
      const uint8_t* qs = blk + (F == Format::Q4_1 ? 4 : 2);
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i low4 = _mm_set1_epi8(0x0f);
      __m128i lo = _mm_and_si128(bytes, low4);
      __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      if constexpr (F == Format::Q4_0) {  // q - 8 in bytes, then signed widening: the same values
        const __m128i eight = _mm_set1_epi8(8);
        lo = _mm_sub_epi8(lo, eight);
        hi = _mm_sub_epi8(hi, eight);
      }
      __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      if constexpr (F == Format::Q4_0) {
        for (int s = 0; s < 4; ++s) w[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[s])));
      } else {
        const __m256 m = _mm256_set1_ps(load_half(blk + 2));
        for (int s = 0; s < 4; ++s)
          w[s] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[s]))), m);
      }
    }
  }
};

struct Avx512 {
  // R rows x PANEL columns of accumulators and the decoded columns fit the 32 registers
  static constexpr int W = 16, ROWS = 4, PANEL = 4;
  using V = __m512;
  static QK_AVX512_TARGET QK_INL V zero() { return _mm512_setzero_ps(); }
  static QK_AVX512_TARGET QK_INL V load(const float* p) { return _mm512_loadu_ps(p); }
  static QK_AVX512_TARGET QK_INL void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static QK_AVX512_TARGET QK_INL V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
  static QK_AVX512_TARGET QK_INL float reduce(V v) {  // the two halves added, then Avx2's tree
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return Avx2::reduce(h);
  }
  template <Format F>
  static QK_AVX512_TARGET QK_INL void decode(const uint8_t* blk, V* w) {
    const __m512 d = _mm512_set1_ps(load_half(blk));
    if constexpr (F == Format::Q8_0) {
      for (int s = 0; s < 2; ++s) {
        __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * s));
        w[s] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
      }
    } else {
      // A block's 16 possible weights, d * (q - 8) or d * q + m for q = 0..15 (rounded as the
      // portable decoder rounds them), form one register; each nibble picks its weight from it
      // (vpermps reads the low 4 bits of an index): no conversion per weight.
      const uint8_t* qs = blk + (F == Format::Q4_1 ? 4 : 2);
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
      __m512 table;
      if constexpr (F == Format::Q4_0) {
        table = _mm512_mul_ps(d, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
      } else {
        table = _mm512_add_ps(_mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                              _mm512_set1_ps(load_half(blk + 2)));
      }
      w[0] = _mm512_permutexvar_ps(idx, table);
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
    }
  }
};
#endif  // QK_X86

}  // namespace qk
