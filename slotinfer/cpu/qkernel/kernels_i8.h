// Products with 8-bit activations (an option, off by default): each row of x is quantized to int8
// per block of 32, row by row, and multiplied with the weights' integers exactly; floats come in
// only to scale a block's integer sums.  AVX512-VNNI's dpbusd where the CPU has it, AVX2's maddubs
// on other x86, portable C++ elsewhere: the same integers and the same float operations in the same
// order, so the same result bit for bit on any CPU (loops_i8.h holds the loops, compiled once per
// instruction set).
//
// What a product computes (the contract every loop set keeps):
//   x's block b of a row: dx = max|x| / 127, q = round-to-nearest-even(x * (1 / dx)) (0 where
//   max|x| is 0), q in [-127, 127].  Blocks go in pairs, 16 lanes of 4 values each: lanes 0-7 the
//   pair's first block, 8-15 its second (a row with an odd count of blocks has a last pair whose
//   second block is zeros).  Per lane, Y = the lane's sum of q.
//   A weight pair is 64 unsigned integers u (the format's q, Q8_0's plus 128) with an offset o
//   (the integer weight is u - o), a factor dw per lane (d; a K-quant's d * sc) and, for Q4_1 and
//   Q4_K, a term mv per lane (Q4_1's m, Q4_K's -dmin * m).
//   For each output, 16 float32 accumulators, lane by lane, for each pair in order:
//     I   = -o * Y + sum of the lane's 4 u * q                          (int32, exact)
//     acc = acc + (float)I * (dw * dx)
//     acc = acc + mv * (dx * (float)Y)                                  (Q4_1 and Q4_K only)
//   each operation rounded once (no fused multiply-add); then the lanes are added in Avx512's
//   reduction tree.  Nothing in it depends on another row, the tiling or the threads: a row alone
//   is the row in any batch.
#pragma once

#include <cmath>
#include <type_traits>
#include <vector>

#include "qkernels.h"
#include "simd.h"

namespace qk {

// The option: set once before use (a change between calls changes the values)
inline bool& int8_activations() {
  static bool on = false;
  return on;
}

// One row's pair of x blocks, quantized, with what the products take from it per lane
struct alignas(64) XPair {
  int8_t q[64];
  int32_t nyo[16];  // -o * Y for the product's format
  float dx[16];     // the block's dx
  float sx[16];     // dx * Y
};

// One column's pair of weight blocks as integers and factors
struct alignas(64) WPair {
  uint8_t u[64];
  float dw[16];
  float mv[16];
};

constexpr int format_offset(Format f) {
  switch (f) {
    case Format::Q8_0: return 128;
    case Format::Q4_0: return 8;
    case Format::Q5_0: return 16;
    case Format::Q6_K: return 32;
    default: return 0;
  }
}

constexpr bool format_has_min(Format f) { return f == Format::Q4_1 || f == Format::Q4_K; }

// Block b's dx and reciprocal from its largest magnitude (shared by every loop set)
inline void x_scale(float amax, float& dx, float& id) {
  dx = amax / 127.0f;
  id = dx != 0.0f ? 1.0f / dx : 0.0f;
}

// Pair p of a weight row, portably (the reference the vector decoders equal)
inline void w_pair_portable(Format f, const uint8_t* row, int nb, int p, WPair& w) {
  std::memset(&w, 0, sizeof w);
  if (block_values(f) != BLOCK) {
    const uint8_t* blk = row + (size_t)(p >> 2) * block_bytes(f);
    const int t = p & 3;
    if (f == Format::Q4_K) {
      KScales ks;
      q4_k_scales(blk + 4, half_to_float(blk), half_to_float(blk + 2), ks);
      const uint8_t* q = blk + 16 + 32 * t;
      for (int i = 0; i < 32; ++i) {
        w.u[i] = q[i] & 0x0f;
        w.u[32 + i] = q[i] >> 4;
      }
      for (int l = 0; l < 16; ++l) {
        const int j = 2 * t + (l >> 3);
        w.dw[l] = ks.a[j];
        w.mv[l] = -ks.a[8 + j];
      }
    } else {  // Q6_K: sub-blocks 2t and 2t + 1
      const float d = half_to_float(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      for (int h = 0; h < 2; ++h) {
        const int J = 2 * t + h, half = J >> 2, j = J & 3;
        const uint8_t* ql = blk + 64 * half + 32 * (j & 1);
        const uint8_t* qh = blk + 128 + 32 * half;
        for (int i = 0; i < 32; ++i)
          w.u[32 * h + i] = (uint8_t)(((ql[i] >> (j & 2 ? 4 : 0)) & 0x0f) | (((qh[i] >> (2 * j)) & 3) << 4));
      }
      for (int l = 0; l < 16; ++l) w.dw[l] = d * (float)sc[4 * t + (l >> 2)];
    }
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const int b = 2 * p + h;
    if (b >= nb) break;
    const uint8_t* blk = row + (size_t)b * block_bytes(f);
    uint8_t* u = w.u + 32 * h;
    const float d = half_to_float(blk);
    float m = 0.0f;
    if (f == Format::Q8_0) {
      for (int i = 0; i < 32; ++i) u[i] = (uint8_t)(blk[2 + i] ^ 0x80);
    } else if (f == Format::Q5_0) {
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      for (int i = 0; i < 16; ++i) {
        u[i] = (uint8_t)((blk[6 + i] & 0x0f) | (((qh >> i) & 1) << 4));
        u[16 + i] = (uint8_t)((blk[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
      }
    } else {  // Q4_0, Q4_1
      const uint8_t* q = blk + (f == Format::Q4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        u[i] = q[i] & 0x0f;
        u[16 + i] = q[i] >> 4;
      }
      if (f == Format::Q4_1) m = half_to_float(blk + 2);
    }
    for (int l = 0; l < 8; ++l) {
      w.dw[8 * h + l] = d;
      w.mv[8 * h + l] = m;
    }
  }
}

// The rows' pairs after quantization, portably: x [m, k] -> xp [m][ceil(nb / 2)]
inline void quantize_rows_portable(const float* x, int m, int k, int off, XPair* xp) {
  const int nb = k / BLOCK, np = (nb + 1) / 2;
  for (int r = 0; r < m; ++r)
    for (int p = 0; p < np; ++p) {
      XPair& o = xp[(size_t)r * np + p];
      std::memset(&o, 0, sizeof o);
      for (int h = 0; h < 2 && 2 * p + h < nb; ++h) {
        const float* v = x + (size_t)r * k + (size_t)(2 * p + h) * BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
        float dx, id;
        x_scale(amax, dx, id);
        for (int i = 0; i < BLOCK; ++i) o.q[32 * h + i] = (int8_t)std::nearbyint(v[i] * id);
        for (int l = 0; l < 8; ++l) o.dx[8 * h + l] = dx;
      }
      for (int l = 0; l < 16; ++l) {
        const int y = o.q[4 * l] + o.q[4 * l + 1] + o.q[4 * l + 2] + o.q[4 * l + 3];
        o.nyo[l] = -off * y;
        o.sx[l] = o.dx[l] * (float)y;
      }
    }
}

// The 16 lanes to one float: Avx512::reduce's tree
inline float reduce16_portable(const float* v) {
  float h[8];
  for (int i = 0; i < 8; ++i) h[i] = v[i] + v[i + 8];
  const float s0 = h[0] + h[4], s1 = h[1] + h[5], s2 = h[2] + h[6], s3 = h[3] + h[7];
  return (s0 + s2) + (s1 + s3);
}

#ifdef QK_X86
#define QK_VNNI512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

inline bool cpu_has_avx512vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}
#endif

#ifdef QK_X86
// A weight pair's integers as two 32-byte halves (lanes 0-7 and 8-15), shared by the AVX2 and VNNI
// loops, which lay them and the factors out in their own registers

QK_AVX2_TARGET QK_INL __m256i i8_nibbles(const uint8_t* q16) {  // 16 bytes -> their low then high nibbles
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q16)), m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// 32 bits to 32 bytes: byte i is 0xff where bit i is set, 0 elsewhere (Q5_0's fifth bits)
QK_AVX2_TARGET QK_INL __m256i bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i takes byte i / 8 of the word (each 128-bit half holds all 4)
      _mm256_set1_epi32((int)bits),
      _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);  // and keeps its bit i % 8
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// Pair t (0-3) of a Q4_K super-block: sub-blocks 2t and 2t + 1, the low and high nibbles of 32 bytes
QK_AVX2_TARGET QK_INL void q4k_pair_bytes(const uint8_t* blk, int t, __m256i (&u)[2]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * t)), m = _mm256_set1_epi8(0x0f);
  u[0] = _mm256_and_si256(b, m);
  u[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}

// Pair t (0-3) of a Q6_K super-block: sub-blocks 2t and 2t + 1 as unsigned 6-bit values, and the
// pair's four scales of 16 weights times d
QK_AVX2_TARGET QK_INL void q6k_pair_bytes(const uint8_t* blk, int t, __m256i (&u)[2]) {
  for (int h = 0; h < 2; ++h) {
    const int J = 2 * t + h, half = J >> 2, j = J & 3;
    __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half + 32 * (j & 1)));
    __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half));
    if (j & 2) lo = _mm256_srli_epi16(lo, 4);
    lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0f));
    hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
    u[h] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
}
QK_AVX2_TARGET QK_INL __m128 q6k_pair_scales(const uint8_t* blk, int t) {
  int32_t s4;
  std::memcpy(&s4, blk + 192 + 4 * t, 4);
  return _mm_mul_ps(_mm_set1_ps(load_half(blk + 208)), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(s4))));
}
#endif

template <class I>
struct KernelsI8;

// Portable: 16 lanes in plain C++
struct I8Portable {};

#define QK_I8_ISA I8Portable
#define QK_I8_TARGET
#define QK_I8_VNNI 0
#define QK_I8_AVX2 0
#include "loops_i8.h"
#undef QK_I8_ISA
#undef QK_I8_TARGET
#undef QK_I8_VNNI
#undef QK_I8_AVX2

#ifdef QK_X86
// AVX2: maddubs and madd, 16 lanes as two vectors of 8
struct I8Avx2 {};

#define QK_I8_ISA I8Avx2
#define QK_I8_TARGET QK_AVX2_TARGET
#define QK_I8_VNNI 0
#define QK_I8_AVX2 1
#include "loops_i8.h"
#undef QK_I8_ISA
#undef QK_I8_TARGET
#undef QK_I8_VNNI
#undef QK_I8_AVX2

struct I8Vnni512 {};

#define QK_I8_ISA I8Vnni512
#define QK_I8_TARGET QK_VNNI512_TARGET
#define QK_I8_VNNI 1
#define QK_I8_AVX2 0
#include "loops_i8.h"
#undef QK_I8_ISA
#undef QK_I8_TARGET
#undef QK_I8_VNNI
#undef QK_I8_AVX2
#endif

// The int8 loops for the instruction set in use: VNNI where the loops in use are AVX-512's and the
// CPU has it, AVX2's where the loops in use are AVX2's or AVX-512's, the portable ones otherwise
// (the same values)
inline const char* int8_loops() {
#ifdef QK_X86
  if (isa() == Isa::Avx512 && cpu_has_avx512vnni()) return "avx512vnni";
  if (isa() != Isa::Portable) return "avx2";
#endif
  return "portable";
}

inline void columns_i8(const Job& job) {
#ifdef QK_X86
  if (isa() == Isa::Avx512 && cpu_has_avx512vnni()) return KernelsI8<I8Vnni512>::columns(job);
  if (isa() != Isa::Portable) return KernelsI8<I8Avx2>::columns(job);
#endif
  KernelsI8<I8Portable>::columns(job);
}

}  // namespace qk
