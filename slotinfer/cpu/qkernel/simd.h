// The instruction sets the loops are written against, one traits type each:
//   V        the accumulator / weight register, W float32 lanes
//   ROWS     how many rows of x a product takes straight from the decoded registers (more rows
//            go through the decoded panel); PANEL: the columns a panel holds
//   WIDE_ROWS: up to WIDE_ROWS rows (more than ROWS) also take the decoded registers straight,
//            a few columns at a time (loops.h's wide_columns)
//   REGISTERS: the vector registers; LIGHT_ROWS: up to this many rows the formats whose blocks
//            decode in a few instructions keep all PANEL columns, their accumulators spilling
//   ROW_COLUMNS: the columns one row takes together in those formats (independent sums that
//            keep the multiply-add units busy: one sum a column is a chain of dependent steps)
//   zero, load, store, fma (acc + a * b, rounded once where the ISA has a fused multiply-add),
//   reduce (the lanes to one float in a fixed tree), decode<F> (the 32 weights b of a weight row,
//   qkernels.h's block_at, to 32 / W registers).
// loops.h is written once against these names.  Portable is the reference: its decode is
// decode_portable, and each vector decoder gives exactly its weights.
#pragma once

#include "qkernels.h"

namespace qk {

#define QK_PORTABLE_TARGET
#define QK_INL inline __attribute__((always_inline))

// 8 lanes in plain C++: the lanes' multiply and add each rounded (no fused multiply-add).
struct Portable {
  static constexpr int W = 8, ROWS = 1, PANEL = 2, WIDE_ROWS = 1, REGISTERS = 16, LIGHT_ROWS = 1, ROW_COLUMNS = 2;
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
  static QK_INL void decode(const uint8_t* row, int b, V* w) {
    float t[BLOCK];
    decode_portable(F, row, b, t);
    for (int s = 0; s < BLOCK / W; ++s) w[s] = load(t + W * s);
  }
  template <Format F>  // a K-quant super-block's factors
  static QK_INL void k_scales(const uint8_t* blk, KScales& ks) {
    if constexpr (F == Format::Q4_K)
      q4_k_scales(blk + 4, half_to_float(blk), half_to_float(blk + 2), ks);
    else
      q6_k_scales(blk, half_to_float(blk + 208), ks);
  }
  template <Format F, int J>  // sub-block J of the super-block blk (the factors are its own)
  static QK_INL void decode_sub(const uint8_t* blk, const KScales&, V* w) {
    decode<F>(blk, J, w);
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

// Q6_K sub-block J = 4 * half + j of a super-block: its 32 six-bit values minus 32, as signed bytes
template <int half, int j>
QK_AVX2_TARGET QK_INL __m256i q6k_bytes(const uint8_t* blk) {
  __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half + 32 * (j & 1)));
  __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half));
  if constexpr (j & 2) lo = _mm256_srli_epi16(lo, 4);
  lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0f));
  hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * j), _mm256_set1_epi8(3)), 4);
  return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

// The same bytes in fewer instructions where AVX-512VL has a ternary logic op: the pair's two bits
// moved to bits 4 and 5 in one shift (what crosses a byte is masked off), then (lo & 0x0f) | hi as
// one op
template <int half, int j>
QK_AVX512_TARGET QK_INL __m256i q6k_bytes_vl(const uint8_t* blk) {
  __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half + 32 * (j & 1)));
  __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half));
  if constexpr (j & 2) lo = _mm256_srli_epi16(lo, 4);
  if constexpr (j < 2) hi = _mm256_slli_epi16(hi, 4 - 2 * j);
  if constexpr (j == 3) hi = _mm256_srli_epi16(hi, 2);
  hi = _mm256_and_si256(hi, _mm256_set1_epi8(0x30));
  return _mm256_sub_epi8(_mm256_ternarylogic_epi32(lo, hi, _mm256_set1_epi8(0x0f), 0xEC), _mm256_set1_epi8(32));
}

// Q4_K's eight 6-bit sc then eight m as 16 bytes (q4_k_unpack's bytes) from the 12 packed bytes at
// s, in a few byte shuffles: the 16 bytes at s are read (the super-block goes on past them).
QK_AVX512_TARGET QK_INL __m128i q4_k_unpack_vl(const uint8_t* s) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const char z = -128;  // a pshufb index that gives 0
  // the low bits: sc 0..3 = s[0..3] & 63, sc 4..7 = s[8..11] & 15, m 0..3 = s[4..7] & 63, m 4..7 = s[8..11] >> 4
  const __m128i low = _mm_and_si128(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, z, z, z, z)),
                                    _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m128i nib = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f)),
                                       _mm_setr_epi8(z, z, z, z, z, z, z, z, z, z, z, z, 8, 9, 10, 11));
  // the high bits of sc 4..7 and m 4..7: the top two bits of s[0..3] and of s[4..7], at bits 4 and 5
  const __m128i top = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)),
                                       _mm_setr_epi8(z, z, z, z, 0, 1, 2, 3, z, z, z, z, 4, 5, 6, 7));
  return _mm_ternarylogic_epi32(low, nib, top, 0xFE);  // low | nib | top
}

struct Avx2 {
  // 16 registers: one row takes a panel's 2 columns from registers (4 in Q4_0, Q4_1 and Q8_0, whose
  // decoding leaves room: 1.04x at one sequence on Zen 3), and up to WIDE_ROWS rows take 1 or 2
  // (loops.h's wide_columns), 9 to 16 rows in two passes.  Timed on Zen 3 (docs/quantized-cpu.md,
  // "On AVX2"), 2 rows cost 0.56x the decoded panel's time and 8 rows 0.75x; 10 or 12 rows at once
  // (their accumulators spilling) cost more than two passes.
  static constexpr int W = 8, ROWS = 1, PANEL = 2, WIDE_ROWS = 8, REGISTERS = 16, LIGHT_ROWS = 4, ROW_COLUMNS = 4;
  using V = __m256;
  static QK_AVX2_TARGET QK_INL V zero() { return _mm256_setzero_ps(); }
  static QK_AVX2_TARGET QK_INL V load(const float* p) { return _mm256_loadu_ps(p); }
  static QK_AVX2_TARGET QK_INL void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static QK_AVX2_TARGET QK_INL V fma(V a, V b, V acc) { return _mm256_fmadd_ps(a, b, acc); }
  static QK_AVX2_TARGET QK_INL float reduce(V v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
    return reduce128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
  }
  template <Format F>  // a K-quant super-block's factors (KScales), 8 at a time
  static QK_AVX2_TARGET QK_INL void k_scales(const uint8_t* blk, KScales& ks) {
    __m128i b;
    __m256 f0, f1;
    if constexpr (F == Format::Q4_K) {
      alignas(16) uint8_t u[16];
      q4_k_unpack(blk + 4, u);
      b = _mm_load_si128(reinterpret_cast<const __m128i*>(u));
      f0 = _mm256_set1_ps(load_half(blk));
      f1 = _mm256_set1_ps(load_half(blk + 2));
      _mm256_storeu_ps(ks.a, _mm256_mul_ps(f0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))));
      _mm256_storeu_ps(ks.a + 8, _mm256_mul_ps(f1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))));
    } else {
      b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      f0 = _mm256_set1_ps(load_half(blk + 208));
      _mm256_storeu_ps(ks.a, _mm256_mul_ps(f0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
      _mm256_storeu_ps(ks.a + 8, _mm256_mul_ps(f0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))));
    }
  }
  // Sub-block J of the super-block blk, its factors unpacked once into ks (KScales): the same
  // weights as decode<F>(row, b, w), with the sub-block's shifts and offsets known at compile time.
  template <Format F, int J>
  static QK_AVX2_TARGET QK_INL void decode_sub(const uint8_t* blk, const KScales& ks, V* w) {
    if constexpr (F == Format::Q4_K) {
      const __m256 D = _mm256_set1_ps(ks.a[J]), M = _mm256_set1_ps(ks.a[8 + J]);
      const uint8_t* q = blk + 16 + 32 * (J >> 1);
      for (int s = 0; s < 4; ++s) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * s)));
        if constexpr (J & 1) v = _mm256_srli_epi32(v, 4);
        v = _mm256_and_si256(v, _mm256_set1_epi32(0x0f));
        w[s] = _mm256_fmsub_ps(D, _mm256_cvtepi32_ps(v), M);
      }
    } else {
      // Q6_K: the 32 six-bit values minus 32 formed in bytes, then widened 8 at a time
      constexpr int half = J >> 2, j = J & 3;
      const __m256i q = q6k_bytes<half, j>(blk);
      const __m128i parts[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      for (int s = 0; s < 4; ++s) {
        __m128i b8 = s & 1 ? _mm_srli_si128(parts[s >> 1], 8) : parts[s >> 1];
        w[s] = _mm256_mul_ps(_mm256_set1_ps(ks.a[8 * half + 2 * j + (s >> 1)]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)));
      }
    }
  }
  template <Format F>
  static QK_AVX2_TARGET QK_INL void decode(const uint8_t* row, int b, V* w) {
    const uint8_t* blk = block_at(F, row, b);
    if constexpr (F == Format::Q4_K) {
      int sc, mn;
      q4_k_scale_min(blk + 4, b & 7, sc, mn);
      const __m256 D = _mm256_set1_ps(load_half(blk) * (float)sc), M = _mm256_set1_ps(load_half(blk + 2) * (float)mn);
      const uint8_t* q = blk + 16 + 32 * ((b & 7) >> 1);
      const __m128i shift = _mm_cvtsi32_si128(4 * (b & 1));
      for (int s = 0; s < 4; ++s) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * s)));
        v = _mm256_and_si256(_mm256_srl_epi32(v, shift), _mm256_set1_epi32(0x0f));
        w[s] = _mm256_fmsub_ps(D, _mm256_cvtepi32_ps(v), M);  // D * q is exact: one rounding, as D * q - M
      }
      return;
    } else if constexpr (F == Format::Q6_K) {
      const int half = (b & 7) >> 2, j = b & 3;
      const uint8_t* ql = blk + 64 * half + 32 * (j & 1);
      const uint8_t* qh = blk + 128 + 32 * half;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * half + 2 * j;
      const float d = load_half(blk + 208);
      const __m128i lsh = _mm_cvtsi32_si128(j & 2 ? 4 : 0), hsh = _mm_cvtsi32_si128(2 * j);
      for (int s = 0; s < 4; ++s) {
        __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql + 8 * s)));
        __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh + 8 * s)));
        lo = _mm256_and_si256(_mm256_srl_epi32(lo, lsh), _mm256_set1_epi32(0x0f));
        hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(hi, hsh), _mm256_set1_epi32(3)), 4);
        __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
        w[s] = _mm256_mul_ps(_mm256_set1_ps(d * (float)sc[s >> 1]), _mm256_cvtepi32_ps(q));
      }
      return;
    }
    const __m256 d = _mm256_set1_ps(load_half(blk));
    if constexpr (F == Format::Q5_0) {
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      const __m256i bits = _mm256_set1_epi32((int)qh), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (int s = 0; s < 4; ++s) {  // weights 8s .. 8s + 7: byte 8 (s & 1) + lane, low nibble for s < 2
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 6 + 8 * (s & 1))));
        if (s >= 2) v = _mm256_srli_epi32(v, 4);
        v = _mm256_and_si256(v, _mm256_set1_epi32(0x0f));
        __m256i h = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * s))),
                                     _mm256_set1_epi32(1));
        v = _mm256_sub_epi32(_mm256_or_si256(v, _mm256_slli_epi32(h, 4)), _mm256_set1_epi32(16));
        w[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
      }
    } else if constexpr (F == Format::Q8_0) {
      for (int s = 0; s < 4; ++s) {
        __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * s));
        w[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
      }
    } else {
      // bytes 0-7 and 8-15 widened to 32-bit lanes once each (two shuffles a block, not six), their
      // low nibbles weights 0-15 and their high nibbles weights 16-31: the same integers
      const uint8_t* qs = blk + (F == Format::Q4_1 ? 4 : 2);
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
      const __m256i low4 = _mm256_set1_epi32(0x0f);
      __m256i q[4] = {_mm256_and_si256(b0, low4), _mm256_and_si256(b1, low4), _mm256_srli_epi32(b0, 4),
                      _mm256_srli_epi32(b1, 4)};
      if constexpr (F == Format::Q4_0) {
        const __m256i eight = _mm256_set1_epi32(8);
        for (int s = 0; s < 4; ++s) w[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[s], eight)));
      } else {
        // d * q is exact (d a half's 11 bits times q's 4): one rounding, as d * q + m
        const __m256 m = _mm256_set1_ps(load_half(blk + 2));
        for (int s = 0; s < 4; ++s) w[s] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[s]), m);
      }
    }
  }
};

struct Avx512 {
  // R rows x PANEL columns of accumulators and the decoded columns fit the 32 registers up to
  // ROWS; up to WIDE_ROWS (a verify step's positions, a small batch) each block still meets the
  // rows straight from its decoding, a few columns at a time (loops.h's wide_columns): on Zen 4
  // that costs less than the decoded panel up to 12 rows, whose 9th row went through a one-row
  // tile (docs/quantized-cpu.md, "A few sequences")
  static constexpr int W = 16, ROWS = 4, PANEL = 4, WIDE_ROWS = 12, REGISTERS = 32, LIGHT_ROWS = 9, ROW_COLUMNS = 4;
  using V = __m512;
  static QK_AVX512_TARGET QK_INL V zero() { return _mm512_setzero_ps(); }
  static QK_AVX512_TARGET QK_INL V load(const float* p) { return _mm512_loadu_ps(p); }
  static QK_AVX512_TARGET QK_INL void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static QK_AVX512_TARGET QK_INL V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
  static QK_AVX512_TARGET QK_INL float reduce(V v) {  // the two halves added, then Avx2's tree
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return Avx2::reduce(h);
  }
  template <Format F>  // a K-quant super-block's factors (KScales), 16 at a time
  static QK_AVX512_TARGET QK_INL void k_scales(const uint8_t* blk, KScales& ks) {
    if constexpr (F == Format::Q4_K) {
      const __m512 f = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(load_half(blk))),
                                                            _mm256_castps_pd(_mm256_set1_ps(load_half(blk + 2))), 1));
      _mm512_storeu_ps(ks.a, _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q4_k_unpack_vl(blk + 4)))));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      _mm512_storeu_ps(ks.a, _mm512_mul_ps(_mm512_set1_ps(load_half(blk + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))));
    }
  }
  // Sub-block J of the super-block blk, its factors unpacked once into ks (KScales): the same
  // weights as decode<F>(row, b, w), with the sub-block's shifts and offsets known at compile time.
  template <Format F, int J>
  static QK_AVX512_TARGET QK_INL void decode_sub(const uint8_t* blk, const KScales& ks, V* w) {
    if constexpr (F == Format::Q4_K) {
      const __m512 table = _mm512_fmsub_ps(_mm512_set1_ps(ks.a[J]),
                                           _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_ps(ks.a[8 + J]));
      const uint8_t* q = blk + 16 + 32 * (J >> 1);
      for (int s = 0; s < 2; ++s) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * s)));
        if constexpr (J & 1) idx = _mm512_srli_epi32(idx, 4);
        w[s] = _mm512_permutexvar_ps(idx, table);
      }
    } else {
      // Q6_K: the 32 six-bit values minus 32 formed in bytes, then widened 16 at a time
      constexpr int half = J >> 2, j = J & 3;
      const __m256i q = q6k_bytes_vl<half, j>(blk);
      w[0] = _mm512_mul_ps(_mm512_set1_ps(ks.a[8 * half + 2 * j]),
                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
      w[1] = _mm512_mul_ps(_mm512_set1_ps(ks.a[8 * half + 2 * j + 1]),
                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    }
  }
  template <Format F>
  static QK_AVX512_TARGET QK_INL void decode(const uint8_t* row, int b, V* w) {
    const uint8_t* blk = block_at(F, row, b);
    if constexpr (F == Format::Q4_K) {
      // the sub-block's 16 possible weights D * q - M as one register, each nibble picking its own
      // (vpermps reads the low 4 bits of an index, so the low nibbles need no mask)
      int sc, mn;
      q4_k_scale_min(blk + 4, b & 7, sc, mn);
      const __m512 table = _mm512_fmsub_ps(_mm512_set1_ps(load_half(blk) * (float)sc),
                                           _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_ps(load_half(blk + 2) * (float)mn));
      const uint8_t* q = blk + 16 + 32 * ((b & 7) >> 1);
      for (int s = 0; s < 2; ++s) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * s)));
        if (b & 1) idx = _mm512_srli_epi32(idx, 4);
        w[s] = _mm512_permutexvar_ps(idx, table);
      }
      return;
    } else if constexpr (F == Format::Q6_K) {
      const int half = (b & 7) >> 2, j = b & 3;
      const uint8_t* ql = blk + 64 * half + 32 * (j & 1);
      const uint8_t* qh = blk + 128 + 32 * half;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * half + 2 * j;
      const float d = load_half(blk + 208);
      const __m128i lsh = _mm_cvtsi32_si128(j & 2 ? 4 : 0), hsh = _mm_cvtsi32_si128(2 * j);
      for (int s = 0; s < 2; ++s) {  // 16 weights, one scale
        __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 16 * s)));
        __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * s)));
        lo = _mm512_and_si512(_mm512_srl_epi32(lo, lsh), _mm512_set1_epi32(0x0f));
        hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(hi, hsh), _mm512_set1_epi32(3)), 4);
        __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, hi), _mm512_set1_epi32(32));
        w[s] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[s]), _mm512_cvtepi32_ps(q));
      }
      return;
    }
    const __m512 d = _mm512_set1_ps(load_half(blk));
    if constexpr (F == Format::Q5_0) {
      // q - 16 formed in 32 bytes (the low nibbles, then the high ones; less 16 where the weight's
      // high bit is clear), then widened and scaled 16 at a time as Q8_0's are: d * (q - 16), the
      // reference's product.  The high bits go in as one 32-bit mask: moving a mask register costs
      // more here than the table lookups it would save (1.08x a one-row product on Zen 4 against
      // two 16-entry tables chosen between under the mask halves).
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6)));
      const __m256i nib = _mm256_and_si256(
          _mm256_srlv_epi16(both, _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4)), _mm256_set1_epi8(0x0f));
      const __m256i q = _mm256_mask_sub_epi8(nib, (__mmask32)~qh, nib, _mm256_set1_epi8(16));
      w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
      w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    } else if constexpr (F == Format::Q8_0) {
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
