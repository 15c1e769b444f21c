// Quantized linear-layer loops: out[m, n] = x[m, k] @ dequant(W)[n, k].T in float32.
//
// W is kept as GGUF stores it: each weight row is k / 32 blocks of 32 weights.
//   Q8_0: f16 d, 32 x int8 q             (34 bytes)  w = d * q
//   Q4_0: f16 d, 16 bytes of nibbles     (18 bytes)  w = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes nibbles (20 bytes)  w = d * q + m
// Nibble j (0..15) of byte i: low nibble is weight i, high nibble weight i + 16.
//
// How a call goes: the columns (weight rows) are taken a panel of C at a time; a panel's blocks
// are decoded once to float32 weights (d * q exactly; d * q + m rounded once for Q4_1: the scales
// are applied here, never in the loop over rows) into a small buffer, and every row of x then
// meets the buffer in tiles of R rows x C columns whose R * C accumulators stay in registers.
// A single row skips the buffer: each block goes from its decoding straight to the row's sums
// (with AVX-512, up to 4 rows do).
//
// Order of the sum (the batch-invariance contract): out[r, j] has one V-lane float32 accumulator
// (V = 8 with AVX2, 16 with AVX-512, 8 portably); for each block b in order, the block's 32 / V
// slices are added with one multiply-add each, in order; the lanes are then reduced in a fixed
// tree.  That order depends on k and the instruction set alone, never on the number of rows, the
// other rows' values, the tiling or the thread count.  The instruction set is chosen once per
// process from the CPU, so on one machine a row's result is the same in every batch.
#pragma once

#include <algorithm>
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
constexpr int ROW_CHUNK = 64;  // rows a decoded panel serves before the next panel is decoded
constexpr int GROUP = 8;       // columns a thread's share goes in (a multiple of every panel width)
constexpr int K_CHUNK = 8;     // blocks of k a row tile takes at a time

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

// One block to 32 floats, portably (the reference the vector decoders equal bit for bit).
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

// The arguments of one thread's share: columns [j0, j1), every row of x.
struct Job {
  Format f;
  const float* x;
  const uint8_t* W;
  float* out;
  int m, k, n, j0, j1;
};

// Software prefetch for the one-row paths, whose columns are read in groups of C whole weight rows,
// one after the next: while block b of a group is computed, the same share of the group PREFETCH
// groups ahead is requested.  The hardware's own prefetch alone leaves a one-row product waiting
// on memory (Q8_0 read 4 GB/s from memory against 16 from cache on one core); this keeps several
// groups' lines in flight.  Prefetches change no value.
constexpr int PREFETCH = 3;

inline void prefetch_group(const Job& job, int j, int C, size_t row_bytes, int b, int bb) {
#ifdef QK_X86
  const int ahead = j + C * PREFETCH;
  if (ahead + C > job.j1) return;
  const char* at = reinterpret_cast<const char*>(job.W + (size_t)ahead * row_bytes + (size_t)b * C * bb);
  for (int off = 0; off < C * bb; off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
#else
  (void)job, (void)j, (void)C, (void)row_bytes, (void)b, (void)bb;
#endif
}

// ---------------------------------------------------------------- portable loops (8 lanes)

inline float reduce8(const float* a) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), as avx2_reduce
  float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

inline void columns_portable(const Job& job) {
  const int nb = job.k / BLOCK, bb = block_bytes(job.f), k = job.k;
  std::vector<float> w((size_t)k);
  for (int j = job.j0; j < job.j1; ++j) {
    const uint8_t* row = job.W + (size_t)j * nb * bb;
    for (int b = 0; b < nb; ++b) decode_portable(job.f, row + (size_t)b * bb, w.data() + (size_t)b * BLOCK);
    for (int r = 0; r < job.m; ++r) {
      const float* xr = job.x + (size_t)r * k;
      float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int i = 0; i < k; i += 8)
        for (int l = 0; l < 8; ++l) a[l] += w[i + l] * xr[i + l];
      job.out[(size_t)r * job.n + j] = reduce8(a);
    }
  }
}

#ifdef QK_X86
// ---------------------------------------------------------------- AVX2 + FMA loops (8 lanes)

#define QK_AVX2 __attribute__((target("avx2,fma,f16c")))

QK_AVX2 inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One block to four 8-weight slices (exactly what decode_portable gives).
template <Format F>
QK_AVX2 inline void decode_avx2(const uint8_t* blk, __m256* w) {
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
      for (int s = 0; s < 4; ++s)
        w[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[s])));
    } else {
      const __m256 m = _mm256_set1_ps(load_half(blk + 2));
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

// R rows x C columns against a decoded panel wp ([nb][C][32] floats); x rows k floats apart.
// R rows x C columns against blocks [b0, b1) of a decoded panel wp ([nb][C][32] floats); x rows k
// floats apart.  The accumulators start at zero (b0 == 0) or from `keep`, and end in `keep` or,
// after the last block, reduced into out.
template <int R, int C>
QK_AVX2 inline void tile_avx2(const float* wp, const float* x, int k, int b0, int b1, float* keep, float* out, int n) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(keep + (r * C + c) * 8);
  wp += (size_t)b0 * C * BLOCK;
  for (int b = b0; b < b1; ++b, wp += C * BLOCK) {
    for (int s = 0; s < 4; ++s) {
      __m256 w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm256_loadu_ps(wp + c * BLOCK + 8 * s);
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(x + (size_t)r * k + b * BLOCK + 8 * s);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(w[c], xv, acc[r][c]);
      }
    }
  }
  if (b1 * BLOCK == k) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[(size_t)r * n + c] = avx2_reduce(acc[r][c]);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(keep + (r * C + c) * 8, acc[r][c]);
  }
}

// One row: each decoded block meets x straight from registers, with the multiply-adds of the
// panel path in the same order (the same sums, bit for bit).
template <Format F, int C>
QK_AVX2 void row_avx2(const Job& job) {
  const int nb = job.k / BLOCK, bb = block_bytes(F);
  const size_t row_bytes = (size_t)nb * bb;
  int j = job.j0;
  for (; j + C <= job.j1; j += C) {
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      prefetch_group(job, j, C, row_bytes, b, bb);
      __m256 w[C][4];
      for (int c = 0; c < C; ++c) decode_avx2<F>(job.W + (j + c) * row_bytes + (size_t)b * bb, w[c]);
      for (int s = 0; s < 4; ++s) {
        __m256 xv = _mm256_loadu_ps(job.x + b * BLOCK + 8 * s);
        for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(w[c][s], xv, acc[c]);
      }
    }
    for (int c = 0; c < C; ++c) job.out[j + c] = avx2_reduce(acc[c]);
  }
  if constexpr (C > 1) {
    if (j < job.j1) {
      Job rest = job;
      rest.j0 = j;
      row_avx2<F, 1>(rest);
    }
  }
}

// Columns [j0, j1) a panel of C at a time: the panel decoded once, then k in chunks of K_CHUNK
// blocks so that a chunk of the panel and of R rows of x stay in L1 while the rows go by.
template <Format F, int C>
QK_AVX2 void panels_avx2(const Job& job, std::vector<float>& buf) {
  if (job.m == 1) return row_avx2<F, C>(job);
  const int nb = job.k / BLOCK, bb = block_bytes(F), k = job.k;
  const size_t row_bytes = (size_t)nb * bb;
  buf.resize((size_t)k * C + (size_t)job.m * C * 8);
  float* wp = buf.data();
  float* keep = wp + (size_t)k * C;
  int j = job.j0;
  for (; j + C <= job.j1; j += C) {
    for (int b = 0; b < nb; ++b)
      for (int c = 0; c < C; ++c) {
        __m256 w[4];
        decode_avx2<F>(job.W + (j + c) * row_bytes + (size_t)b * bb, w);
        for (int s = 0; s < 4; ++s) _mm256_storeu_ps(wp + (b * C + c) * BLOCK + 8 * s, w[s]);
      }
    for (int b0 = 0; b0 < nb; b0 += K_CHUNK) {
      const int b1 = std::min(nb, b0 + K_CHUNK);
      int r = 0;
      for (; r + 4 <= job.m; r += 4)
        tile_avx2<4, C>(wp, job.x + (size_t)r * k, k, b0, b1, keep + (size_t)r * C * 8, job.out + (size_t)r * job.n + j, job.n);
      for (; r < job.m; ++r)
        tile_avx2<1, C>(wp, job.x + (size_t)r * k, k, b0, b1, keep + (size_t)r * C * 8, job.out + (size_t)r * job.n + j, job.n);
    }
  }
  if constexpr (C > 1) {
    if (j < job.j1) {
      Job rest = job;
      rest.j0 = j;
      panels_avx2<F, 1>(rest, buf);
    }
  }
}

inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// ---------------------------------------------------------------- AVX-512 loops (16 lanes)

#define QK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

template <Format F>
QK_AVX512 inline void decode_avx512(const uint8_t* blk, __m512* w) {
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

QK_AVX512 inline float avx512_reduce(__m512 v) {  // the two halves added, then avx2_reduce's tree
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
  return _mm_cvtss_f32(u);
}

// R rows x C columns against blocks [b0, b1) of a decoded panel wp ([nb][C][32] floats); x rows k
// floats apart.  The accumulators start at zero (b0 == 0) or from `keep`, and end in `keep` or,
// after the last block, reduced into out.
template <int R, int C>
QK_AVX512 inline void tile_avx512(const float* wp, const float* x, int k, int b0, int b1, float* keep, float* out, int n) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(keep + (r * C + c) * 16);
  wp += (size_t)b0 * C * BLOCK;
  for (int b = b0; b < b1; ++b, wp += C * BLOCK) {
    for (int s = 0; s < 2; ++s) {
      __m512 w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_ps(wp + c * BLOCK + 16 * s);
      for (int r = 0; r < R; ++r) {
        __m512 xv = _mm512_loadu_ps(x + (size_t)r * k + b * BLOCK + 16 * s);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[c], xv, acc[r][c]);
      }
    }
  }
  if (b1 * BLOCK == k) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[(size_t)r * n + c] = avx512_reduce(acc[r][c]);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(keep + (r * C + c) * 16, acc[r][c]);
  }
}

// Up to 4 rows: each decoded block meets the rows of x straight from registers, with the
// multiply-adds of the panel path in the same order (the same sums, bit for bit).  R rows x C
// columns of accumulators and the C decoded columns fit the 32 registers.
template <Format F, int C, int R>
QK_AVX512 void rows_avx512(const Job& job) {
  const int nb = job.k / BLOCK, bb = block_bytes(F);
  const size_t row_bytes = (size_t)nb * bb;
  int j = job.j0;
  for (; j + C <= job.j1; j += C) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      prefetch_group(job, j, C, row_bytes, b, bb);
      __m512 w[C][2];
      for (int c = 0; c < C; ++c) decode_avx512<F>(job.W + (j + c) * row_bytes + (size_t)b * bb, w[c]);
      for (int s = 0; s < 2; ++s)
        for (int r = 0; r < R; ++r) {
          __m512 xv = _mm512_loadu_ps(job.x + (size_t)r * job.k + b * BLOCK + 16 * s);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[c][s], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) job.out[(size_t)r * job.n + j + c] = avx512_reduce(acc[r][c]);
  }
  if constexpr (C > 1) {
    if (j < job.j1) {
      Job rest = job;
      rest.j0 = j;
      rows_avx512<F, 1, R>(rest);
    }
  }
}

// Columns [j0, j1) a panel of C at a time: the panel decoded once, then k in chunks of K_CHUNK
// blocks so that a chunk of the panel and of R rows of x stay in L1 while the rows go by.
template <Format F, int C>
QK_AVX512 void panels_avx512(const Job& job, std::vector<float>& buf) {
  switch (job.m) {  // a few rows skip the buffer
    case 1: return rows_avx512<F, C, 1>(job);
    case 2: return rows_avx512<F, C, 2>(job);
    case 3: return rows_avx512<F, C, 3>(job);
    case 4: return rows_avx512<F, C, 4>(job);
  }
  const int nb = job.k / BLOCK, bb = block_bytes(F), k = job.k;
  const size_t row_bytes = (size_t)nb * bb;
  buf.resize((size_t)k * C + (size_t)job.m * C * 16);
  float* wp = buf.data();
  float* keep = wp + (size_t)k * C;
  int j = job.j0;
  for (; j + C <= job.j1; j += C) {
    for (int b = 0; b < nb; ++b)
      for (int c = 0; c < C; ++c) {
        __m512 w[2];
        decode_avx512<F>(job.W + (j + c) * row_bytes + (size_t)b * bb, w);
        for (int s = 0; s < 2; ++s) _mm512_storeu_ps(wp + (b * C + c) * BLOCK + 16 * s, w[s]);
      }
    for (int b0 = 0; b0 < nb; b0 += K_CHUNK) {
      const int b1 = std::min(nb, b0 + K_CHUNK);
      int r = 0;
      for (; r + 4 <= job.m; r += 4)
        tile_avx512<4, C>(wp, job.x + (size_t)r * k, k, b0, b1, keep + (size_t)r * C * 16, job.out + (size_t)r * job.n + j, job.n);
      for (; r < job.m; ++r)
        tile_avx512<1, C>(wp, job.x + (size_t)r * k, k, b0, b1, keep + (size_t)r * C * 16, job.out + (size_t)r * job.n + j, job.n);
    }
  }
  if constexpr (C > 1) {
    if (j < job.j1) {
      Job rest = job;
      rest.j0 = j;
      panels_avx512<F, 1>(rest, buf);
    }
  }
}

inline bool cpu_has_avx512() {
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
}
#endif  // QK_X86

// ---------------------------------------------------------------- choice of loops

enum class Isa { Portable = 0, Avx2 = 1, Avx512 = 2 };

inline Isa best_isa() {
#ifdef QK_X86
  if (cpu_has_avx512()) return Isa::Avx512;
  if (cpu_has_avx2()) return Isa::Avx2;
#endif
  return Isa::Portable;
}

// The loops in use: the best the CPU has, unless lowered (the tests hold every set to the same
// properties).  Set once before use; a change between calls changes the order of the sums.
inline Isa& isa() {
  static Isa chosen = best_isa();
  return chosen;
}

inline const char* isa_name(Isa i) {
  switch (i) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "portable";
  }
}

// One thread's share, rows in chunks of ROW_CHUNK so a chunk of x stays in the L2 cache.
inline void columns(const Job& job, std::vector<float>& buf) {
  for (int r0 = 0; r0 < job.m; r0 += ROW_CHUNK) {
    Job part = job;
    part.x = job.x + (size_t)r0 * job.k;
    part.out = job.out + (size_t)r0 * job.n;
    part.m = std::min(ROW_CHUNK, job.m - r0);
#ifdef QK_X86
    if (isa() == Isa::Avx512) {
      switch (job.f) {
        case Format::Q8_0: panels_avx512<Format::Q8_0, 4>(part, buf); continue;
        case Format::Q4_0: panels_avx512<Format::Q4_0, 4>(part, buf); continue;
        case Format::Q4_1: panels_avx512<Format::Q4_1, 4>(part, buf); continue;
      }
    }
    if (isa() == Isa::Avx2) {
      switch (job.f) {
        case Format::Q8_0: panels_avx2<Format::Q8_0, 2>(part, buf); continue;
        case Format::Q4_0: panels_avx2<Format::Q4_0, 2>(part, buf); continue;
        case Format::Q4_1: panels_avx2<Format::Q4_1, 2>(part, buf); continue;
      }
    }
#endif
    columns_portable(part);
  }
}

}  // namespace qk
