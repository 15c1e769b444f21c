// Quantized linear-layer loops: out[m, n] = x[m, k] @ dequant(W)[n, k].T in float32.
//
// W is kept as GGUF stores it: each weight row is k / 32 blocks of 32 weights.
//   Q8_0: f16 d, 32 x int8 q             (34 bytes)  w = d * q
//   Q4_0: f16 d, 16 bytes of nibbles     (18 bytes)  w = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes nibbles (20 bytes)  w = d * q + m
// Nibble j (0..15) of byte i: low nibble is weight i, high nibble weight i + 16.
//
// Order of the sum (the batch-invariance contract): out[r, j] has one 8-lane float32
// accumulator; for each block b in order, the block's four 8-weight slices are added
// with one multiply-add each, in order; the lanes are then reduced in a fixed tree.
// That order depends on k alone, never on the number of rows, the other rows' values,
// the column tiling or the thread count.  Weights are decoded once per block and used
// for every row of the call (up to ROW_CHUNK rows), so a call reads the weights once.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QK_X86 1
#endif

namespace qk {

enum class Format { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

constexpr int BLOCK = 32;
constexpr int ROW_CHUNK = 32;  // rows whose accumulators a column group keeps at once
constexpr int GROUP = 8;       // columns a thread's share and the AVX2 loops go in
constexpr int K_CHUNK = 4;     // blocks of k a column group takes at a time

inline int block_bytes(Format f) {
  switch (f) {
    case Format::Q8_0: return 34;
    case Format::Q4_0: return 18;
    case Format::Q4_1: return 20;
  }
  return 0;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400u));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The loops below take x packed by pack_rows: rows [r0, r1) block by block, each block's rows
// side by side ([k / 32][r1 - r0][32]), so the rows a decoded block meets are contiguous.  Rows
// read in place would sit k floats apart, and with k a multiple of 1024 every row falls in the
// same L1 cache set.
inline void pack_rows(const float* x, int k, int r0, int r1, float* xp) {
  const int nb = k / BLOCK, rows = r1 - r0;
  for (int r = r0; r < r1; ++r)
    for (int b = 0; b < nb; ++b)
      std::memcpy(xp + ((size_t)b * rows + (r - r0)) * BLOCK, x + (size_t)r * k + (size_t)b * BLOCK,
                  BLOCK * sizeof(float));
}

// ---------------------------------------------------------------- portable loops

// Decode one block to 32 floats.
inline void decode_portable(Format f, const uint8_t* blk, float* w) {
  float d = half_to_float(blk);
  if (f == Format::Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int i = 0; i < 32; ++i) w[i] = d * (float)q[i];
  } else if (f == Format::Q4_0) {
    const uint8_t* q = blk + 2;
    for (int i = 0; i < 16; ++i) {
      w[i] = d * (float)((int)(q[i] & 0x0f) - 8);
      w[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
    }
  } else {
    float m = half_to_float(blk + 2);
    const uint8_t* q = blk + 4;
    for (int i = 0; i < 16; ++i) {
      w[i] = d * (float)(q[i] & 0x0f) + m;
      w[i + 16] = d * (float)(q[i] >> 4) + m;
    }
  }
}

inline float reduce8(const float* a) {  // the fixed tree, as the AVX2 reduction
  float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

// Columns [j0, j1) of out for rows [r0, r1).
inline void columns_portable(Format f, const float* x, const uint8_t* W, float* out, int k, int n,
                             int r0, int r1, int j0, int j1) {
  const int nb = k / BLOCK, bb = block_bytes(f);
  std::vector<float> acc((size_t)(r1 - r0) * 8);
  float w[32];
  for (int j = j0; j < j1; ++j) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const uint8_t* row = W + (size_t)j * nb * bb;
    for (int b = 0; b < nb; ++b) {
      decode_portable(f, row + (size_t)b * bb, w);
      for (int r = r0; r < r1; ++r) {
        const float* xr = x + ((size_t)b * (r1 - r0) + (r - r0)) * BLOCK;
        float* a = acc.data() + (size_t)(r - r0) * 8;
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 8; ++l) a[l] += w[8 * s + l] * xr[8 * s + l];
      }
    }
    for (int r = r0; r < r1; ++r) out[(size_t)r * n + j] = reduce8(acc.data() + (size_t)(r - r0) * 8);
  }
}

// ---------------------------------------------------------------- AVX2 + FMA loops
#ifdef QK_X86

#define QK_AVX2 __attribute__((target("avx2,fma,f16c")))

QK_AVX2 inline __m256 avx2_scale(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_set1_ps(_cvtsh_ss(h));
}

// Decode one block to four 8-weight slices (exactly d * q [+ m] in float32).
template <Format F>
QK_AVX2 inline void decode_avx2(const uint8_t* blk, __m256* w) {
  const __m256 d = avx2_scale(blk);
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
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    if constexpr (F == Format::Q4_0) {  // q - 8 in bytes, then signed widening: the same values
      const __m128i eight = _mm_set1_epi8(8);
      for (int s = 0; s < 4; s += 2) {
        __m128i centred = _mm_sub_epi8(parts[s], eight);
        w[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(centred)));
        w[s + 1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(centred, 8))));
      }
    } else {
      const __m256 m = avx2_scale(blk + 2);
      for (int s = 0; s < 4; ++s)
        w[s] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[s]))), m);
    }
  }
}

QK_AVX2 inline float avx2_reduce(__m256 v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
  return _mm_cvtss_f32(u);
}

// NC weight rows at a time, every row of [r0, r1) against each decoded block.  The columns go
// in groups of GROUP and k in chunks of K_CHUNK blocks, so that the chunk of x the group reuses
// stays in L1; each accumulator still takes its blocks in order.

template <Format F, int NC>
QK_AVX2 void columns_avx2_tile(const float* x, const uint8_t* W, float* out, int k, int n, int r0, int r1,
                               int j0, int j1, __m256* acc) {
  static_assert(GROUP % NC == 0);
  const int nb = k / BLOCK, bb = block_bytes(F), rows = r1 - r0;
  const size_t row_bytes = (size_t)nb * bb;
  int g = j0;
  for (; g + GROUP <= j1; g += GROUP) {
    for (int i = 0; i < rows * GROUP; ++i) acc[i] = _mm256_setzero_ps();
    const int chunk = rows <= 2 ? nb : K_CHUNK;  // a row or two of x stays in L1 whole
    for (int b0 = 0; b0 < nb; b0 += chunk) {
      const int b1 = b0 + chunk < nb ? b0 + chunk : nb;
      for (int j = g; j < g + GROUP; j += NC) {
        __m256* a_j = acc + (j - g);
        for (int b = b0; b < b1; ++b) {
          __m256 w[NC][4];
          for (int c = 0; c < NC; ++c) decode_avx2<F>(W + (j + c) * row_bytes + (size_t)b * bb, w[c]);
          const float* xb = x + (size_t)b * rows * BLOCK;
          for (int r = 0; r < rows; ++r, xb += BLOCK) {
            __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            for (int c = 0; c < NC; ++c) {
              __m256 a = a_j[r * GROUP + c];
              a = _mm256_fmadd_ps(w[c][0], x0, a);
              a = _mm256_fmadd_ps(w[c][1], x1, a);
              a = _mm256_fmadd_ps(w[c][2], x2, a);
              a = _mm256_fmadd_ps(w[c][3], x3, a);
              a_j[r * GROUP + c] = a;
            }
          }
        }
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < GROUP; ++c) out[(size_t)(r0 + r) * n + g + c] = avx2_reduce(acc[r * GROUP + c]);
  }
  if (g < j1) {  // the last columns, one at a time, in the same order
    if constexpr (NC == 1) {
      for (int j = g; j < j1; ++j) {
        for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; ++b) {
          __m256 w[4];
          decode_avx2<F>(W + j * row_bytes + (size_t)b * bb, w);
          const float* xb = x + (size_t)b * rows * BLOCK;
          for (int r = 0; r < rows; ++r, xb += BLOCK) {
            __m256 a = acc[r];
            a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a);
            a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), a);
            a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), a);
            a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), a);
            acc[r] = a;
          }
        }
        for (int r = 0; r < rows; ++r) out[(size_t)(r0 + r) * n + j] = avx2_reduce(acc[r]);
      }
    } else {
      columns_avx2_tile<F, 1>(x, W, out, k, n, r0, r1, g, j1, acc);
    }
  }
}

template <Format F>
QK_AVX2 void columns_avx2(const float* x, const uint8_t* W, float* out, int k, int n, int r0, int r1,
                          int j0, int j1) {
  alignas(32) __m256 acc[ROW_CHUNK * GROUP];
  // Few rows: more weight rows in flight hide the multiply-add latency of each chain.
  if (r1 - r0 <= 2)
    columns_avx2_tile<F, 4>(x, W, out, k, n, r0, r1, j0, j1, acc);
  else
    columns_avx2_tile<F, 2>(x, W, out, k, n, r0, r1, j0, j1, acc);
}

inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}
#endif  // QK_X86

inline bool& portable_forced() {
  static bool forced = false;
  return forced;
}

inline void columns(Format f, const float* x, const uint8_t* W, float* out, int k, int n, int r0, int r1,
                    int j0, int j1) {
#ifdef QK_X86
  if (cpu_has_avx2() && !portable_forced()) {
    switch (f) {
      case Format::Q8_0: return columns_avx2<Format::Q8_0>(x, W, out, k, n, r0, r1, j0, j1);
      case Format::Q4_0: return columns_avx2<Format::Q4_0>(x, W, out, k, n, r0, r1, j0, j1);
      case Format::Q4_1: return columns_avx2<Format::Q4_1>(x, W, out, k, n, r0, r1, j0, j1);
    }
  }
#endif
  columns_portable(f, x, W, out, k, n, r0, r1, j0, j1);
}

}  // namespace qk
