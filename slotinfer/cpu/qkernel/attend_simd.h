// Decode attention's inner loops per instruction set (decode_ops.h's attend_heads calls them a
// block of keys or values at a time): the scores of a block of keys against a K/V head's query
// heads, and the heads' weighted sums of a block of values.  dot() also serves RMSNorm.
//
// dot() is the contract: 16 lanes (lane l takes i = l mod 16), each product rounded and then added
// (the extension is compiled with -ffp-contract=off), then a fixed tree of the lanes (lane l plus
// lane l + 8, then + 4, + 2, + 1), then the tail past the last 16 in order.  KeyScores<I, DC> gives
// every key's dot() bit for bit, but the vector ones take 16 keys (8 with AVX2) at a time: each
// key's 16 lanes are formed by the same multiplies and adds in the same order, and the 16 keys'
// trees then run together, transposed, one register at a time, so that each add of the tree is the
// same add (a lane and the lane w above it, in that order) for 16 keys at once.  The tree costs
// 15 adds and 30 shuffles for 16 keys instead of 4 adds and 4 shuffles each, and the keys' sums
// do not wait on one another.  Head sizes that are not a multiple of 16, and the last keys of a
// block short of 16 (8), go through dot() key by key.
//
// ValueSums<I, DC> adds a block of values to the heads' weighted sums: for each head, position by
// position in order, a weight e that is not 0 adds e to the head's total and e * v (each product
// rounded, then added) to its sums.  The vector form takes up to 4 heads at once (as many as 16
// registers of sums hold), each value row read once for all of them; a head's adds are the same,
// in the same order, whichever heads it goes with.
//
// DequantRows<I> turns a block's q8_0 rows into floats, d * q (one rounding), the rows asked for.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd.h"

namespace qk {

#define QK_INLINE inline __attribute__((always_inline))

// A sum of n products in 16 lanes (lane l takes i = l mod 16), then a fixed tree; the tail in order.
QK_INLINE float dot(const float* a, const float* b, int n) {
  float acc[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  float s = acc[0];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// A row of D values (D a multiple of 32) from its q8_0 blocks: d * q
QK_INLINE void dequant_q8_row(const uint8_t* src, int D, float* dst) {
  for (int c = 0; c < D / 32; ++c) {
    const uint8_t* blk = src + (size_t)c * 34;
    const float d = half_to_float(blk);
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int i = 0; i < 32; ++i) dst[c * 32 + i] = d * (float)q[i];
  }
}

// Bytes of a row of D values in q8_0 blocks
inline int q8_row_bytes(int D) { return D / 32 * 34; }

// The rows p < n of a block of q8_0 rows (src, q8_row_bytes(D) apart) whose need[p] is set (need
// null: every row) into dst [n, D] floats; the others left as they were.
template <class I>
struct DequantRows {
  static QK_INLINE void run(const uint8_t* src, int n, int D, const uint8_t* need, float* dst) {
    const size_t rb = q8_row_bytes(D);
    for (int p = 0; p < n; ++p)
      if (!need || need[p]) dequant_q8_row(src + p * rb, D, dst + (size_t)p * D);
  }
};

// out[r * stride + p] = dot(q + r * D, k + p * D, D) for the rep query heads r and the n keys p
// (rows D floats apart); DC: D when known at compile time, else 0.  The plain loop: key by key.
template <class I, int DC>
struct KeyScores {
  static QK_INLINE void run(const float* q, int rep, int D, const float* k, int n, float* out, size_t stride) {
    for (int p = 0; p < n; ++p)
      for (int r = 0; r < rep; ++r) out[r * stride + p] = dot(q + (size_t)r * D, k + (size_t)p * D, D);
  }
};

// Adds the block's n value rows v (D floats apart) to the sums acc [rep, D] and totals of the heads
// r whose `live` is set, with their weights s[r * stride + p] (0: the position adds nothing).
template <class I, int DC>
struct ValueSums {
  static QK_INLINE void run(const float* s, size_t stride, int rep, const uint8_t* live, const float* v, int n, int D,
                            float* acc, float* sums) {
    for (int r = 0; r < rep; ++r) {
      if (!live[r]) continue;
      float reg[DC ? DC : 1];  // a known head size: the sums in registers
      float* a = DC ? reg : acc + (size_t)r * D;
      if (DC)
        for (int d = 0; d < D; ++d) a[d] = acc[(size_t)r * D + d];
      float sum = sums[r];
      for (int p = 0; p < n; ++p) {
        const float e = s[r * stride + p];
        if (e == 0.0f) continue;
        sum += e;
        const float* vp = v + (size_t)p * D;
        for (int d = 0; d < D; ++d) a[d] += e * vp[d];
      }
      sums[r] = sum;
      if (DC)
        for (int d = 0; d < D; ++d) acc[(size_t)r * D + d] = a[d];
    }
  }
};

#ifdef QK_X86
// The trees of 16 keys' lanes a[0..15] at once: lane i of the result is dot()'s tree of the key in
// a[(i % 4) * 4 + i / 4].  Each step adds a register of the lanes l (below w) to one of the lanes
// l + w, for two keys' halves (then four keys' quarters, ...) side by side.
QK_AVX512_TARGET QK_INL __m512 trees16(const __m512* a) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // w = 8: [a lanes 0-7 | b lanes 0-7] + [a 8-15 | b 8-15]
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // w = 4: four keys' lanes 0-3 + their lanes 4-7
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // w = 2, within each 128 bits: lanes 0-1 + lanes 2-3 of two keys
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));  // w = 1
}

template <int DC>
struct KeyScores<Avx512, DC> {
  static QK_AVX512_TARGET void run(const float* q, int rep, int D, const float* k, int n, float* out, size_t stride) {
    if constexpr (DC % 16 != 0) return KeyScores<Portable, DC>::run(q, rep, D, k, n, out, stride);
    if (DC == 0 && D % 16 != 0) return KeyScores<Portable, DC>::run(q, rep, D, k, n, out, stride);
    const int Dv = DC ? DC : D;
    int p = 0;
    for (; p + 16 <= n; p += 16) {
      const float* kp = k + (size_t)p * Dv;
      for (int r = 0; r < rep; ++r) {
        const float* qr = q + (size_t)r * Dv;
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int c = 0; c < Dv; c += 16) {
          const __m512 qv = _mm512_loadu_ps(qr + c);
          for (int i = 0; i < 16; ++i)  // slot i holds key (i % 4) * 4 + i / 4: the trees leave key i in lane i
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(qv, _mm512_loadu_ps(kp + (size_t)((i & 3) * 4 + (i >> 2)) * Dv + c)));
        }
        _mm512_storeu_ps(out + r * stride + p, trees16(acc));
      }
    }
    if (p < n) KeyScores<Portable, DC>::run(q, rep, D, k + (size_t)p * Dv, n - p, out + p, stride);
  }
};

// G heads' sums (C registers each) over the block, each value row loaded once for them all
template <int G, int C>
QK_AVX512_TARGET QK_INL void value_sums16(const float* s, size_t stride, const float* v, int n, float* acc,
                                          float* sums) {
  constexpr int D = 16 * C;
  __m512 a[G][C];
  float sum[G];
  for (int g = 0; g < G; ++g) {
    sum[g] = sums[g];
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  }
  for (int p = 0; p < n; ++p) {
    __m512 vp[C];
    for (int c = 0; c < C; ++c) vp[c] = _mm512_loadu_ps(v + (size_t)p * D + 16 * c);
    for (int g = 0; g < G; ++g) {
      const float e = s[g * stride + p];
      if (e == 0.0f) continue;
      sum[g] += e;
      const __m512 ev = _mm512_set1_ps(e);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_add_ps(a[g][c], _mm512_mul_ps(ev, vp[c]));
    }
  }
  for (int g = 0; g < G; ++g) {
    sums[g] = sum[g];
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
  }
}

template <int DC>
struct ValueSums<Avx512, DC> {
  static QK_AVX512_TARGET void run(const float* s, size_t stride, int rep, const uint8_t* live, const float* v, int n,
                                   int D, float* acc, float* sums) {
    if constexpr (DC == 0 || DC % 16 != 0 || DC > 256) {
      return ValueSums<Portable, DC>::run(s, stride, rep, live, v, n, D, acc, sums);
    } else {
      constexpr int C = DC / 16, G = C <= 4 ? 4 : 16 / C;  // at most 16 registers of sums
      int r = 0;
      while (r < rep) {
        if (!live[r]) {
          ++r;
          continue;
        }
        int g = 1;  // the live heads from r on, up to G
        while (g < G && r + g < rep && live[r + g]) ++g;
        const float* sr = s + r * stride;
        float* ar = acc + (size_t)r * DC;
        if (g == 1) value_sums16<1, C>(sr, stride, v, n, ar, sums + r);
        if constexpr (G >= 2)
          if (g == 2) value_sums16<2, C>(sr, stride, v, n, ar, sums + r);
        if constexpr (G >= 3)
          if (g == 3) value_sums16<3, C>(sr, stride, v, n, ar, sums + r);
        if constexpr (G >= 4)
          if (g == 4) value_sums16<4, C>(sr, stride, v, n, ar, sums + r);
        r += g;
      }
    }
  }
};

template <>
struct DequantRows<Avx512> {
  static QK_AVX512_TARGET void run(const uint8_t* src, int n, int D, const uint8_t* need, float* dst) {
    const size_t rb = q8_row_bytes(D);
    for (int p = 0; p < n; ++p) {
      if (need && !need[p]) continue;
      const uint8_t* row = src + p * rb;
      float* out = dst + (size_t)p * D;
      for (int c = 0; c < D / 32; ++c) {
        const uint8_t* blk = row + (size_t)c * 34;
        const __m512 d = _mm512_set1_ps(half_to_float(blk));
        for (int s = 0; s < 2; ++s) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * s));
          _mm512_storeu_ps(out + 32 * c + 16 * s, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
        }
      }
    }
  }
};

// The trees of 8 keys whose lanes l and l + 8 are already added (dot()'s w = 8 step), 8 lanes each:
// lane i of the result is the rest of the tree of a[j], j = 0, 2, 4, 6, 1, 3, 5, 7 for i = 0 .. 7.
QK_AVX2_TARGET QK_INL __m256 trees8(const __m256* a) {
  __m256 s[4], t[2];
  for (int i = 0; i < 4; ++i)  // w = 4: [a lanes 0-3 | b lanes 0-3] + [a 4-7 | b 4-7]
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // w = 2, within each 128 bits
    t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xDD));  // w = 1
}

template <int DC>
struct KeyScores<Avx2, DC> {
  static QK_AVX2_TARGET void run(const float* q, int rep, int D, const float* k, int n, float* out, size_t stride) {
    if constexpr (DC % 16 != 0) return KeyScores<Portable, DC>::run(q, rep, D, k, n, out, stride);
    if (DC == 0 && D % 16 != 0) return KeyScores<Portable, DC>::run(q, rep, D, k, n, out, stride);
    const int Dv = DC ? DC : D;
    int p = 0;
    for (; p + 8 <= n; p += 8) {
      const float* kp = k + (size_t)p * Dv;
      for (int r = 0; r < rep; ++r) {
        const float* qr = q + (size_t)r * Dv;
        __m256 part[8];
        for (int i = 0; i < 8; ++i) {  // slot i holds key (i % 2) * 4 + i / 2
          const float* kk = kp + (size_t)((i & 1) * 4 + (i >> 1)) * Dv;
          __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15
          for (int c = 0; c < Dv; c += 16) {
            lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(qr + c), _mm256_loadu_ps(kk + c)));
            hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(qr + c + 8), _mm256_loadu_ps(kk + c + 8)));
          }
          part[i] = _mm256_add_ps(lo, hi);
        }
        _mm256_storeu_ps(out + r * stride + p, trees8(part));
      }
    }
    if (p < n) KeyScores<Portable, DC>::run(q, rep, D, k + (size_t)p * Dv, n - p, out + p, stride);
  }
};
template <>
struct DequantRows<Avx2> {
  static QK_AVX2_TARGET void run(const uint8_t* src, int n, int D, const uint8_t* need, float* dst) {
    const size_t rb = q8_row_bytes(D);
    for (int p = 0; p < n; ++p) {
      if (need && !need[p]) continue;
      const uint8_t* row = src + p * rb;
      float* out = dst + (size_t)p * D;
      for (int c = 0; c < D / 32; ++c) {
        const uint8_t* blk = row + (size_t)c * 34;
        const __m256 d = _mm256_set1_ps(half_to_float(blk));
        for (int s = 0; s < 4; ++s) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * s));
          _mm256_storeu_ps(out + 32 * c + 8 * s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        }
      }
    }
  }
};
#endif  // QK_X86

}  // namespace qk
