// Quantized linear layers, out[m, n] = x[m, k] @ dequant(W)[n, k].T in float32: the formats, the
// reference block decoder, a thread's job and the choice of instruction set.  The loops are in
// loops.h, written once against simd.h's traits; kernels.h compiles them per instruction set.
//
// W is kept as GGUF stores it: each weight row is k / 32 blocks of 32 weights, or k / 256
// super-blocks of 256 for the K-quants, read as eight sub-blocks of 32.
//   Q8_0: f16 d, 32 x int8 q             (34 bytes)  w = d * q
//   Q4_0: f16 d, 16 bytes of nibbles     (18 bytes)  w = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes nibbles (20 bytes)  w = d * q + m
//   Q5_0: f16 d, 32 high bits, nibbles   (22 bytes)  w = d * (q - 16), q = nibble | high bit << 4
// Nibble j (0..15) of byte i: low nibble is weight i, high nibble weight i + 16 (bit i of Q5_0's
// high bits goes with weight i).
//   Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit sc and m (eight each), 128 bytes of nibbles (144 bytes
//         per 256): w = (d * sc) * q - dmin * m per sub-block of 32; sub-blocks 2c and 2c + 1 are the
//         low and high nibbles of bytes 32c .. 32c + 31.
//   Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 x int8 sc, f16 d (210 bytes per
//         256): w = (d * sc) * (q - 32) per 16 weights, q 6 bits.
// Every one of these is exact in float32: d * sc is a float16 times an integer of at most 8 bits, and
// its product with q of at most 6 bits still fits float32's 24-bit significand; the decoders compute
// it as gguf's reference does (d * sc, then * q, then - dmin * m, the one rounding), so a decoded
// weight is the reference's value bit for bit.
//
// How a call goes: the columns (weight rows) are taken a panel of C at a time; a panel's blocks
// are decoded once to float32 weights (d * q exactly; d * q + m rounded once for Q4_1: the scales
// are applied here, never in the loop over rows) into a small buffer, and every row of x then
// meets the buffer in tiles of R rows x C columns whose R * C accumulators stay in registers.
// A few rows skip the buffer: each block goes from its decoding straight to the rows' sums
// (one row; with AVX-512, up to 8).
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

enum class Format { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q4_K = 4, Q6_K = 5 };

constexpr int BLOCK = 32;
constexpr int ROW_CHUNK = 64;  // rows a decoded panel serves before the next panel is decoded
constexpr int GROUP = 8;       // columns a thread's share goes in (a multiple of every panel width)
constexpr int K_CHUNK_BYTES = 10240;  // at most the bytes of decoded panel a row tile takes at a time
constexpr int TILE_ROWS = 4;   // rows of x a tile of the decoded panel takes at a time

// A block's bytes and weights as stored (a K-quant's super-block); the loops take 32 weights at a
// time (sub_block), whatever the format.
constexpr int block_bytes(Format f) {
  switch (f) {
    case Format::Q8_0: return 34;
    case Format::Q4_0: return 18;
    case Format::Q4_1: return 20;
    case Format::Q5_0: return 22;
    case Format::Q4_K: return 144;
    case Format::Q6_K: return 210;
  }
  return 0;
}

constexpr int block_values(Format f) { return f == Format::Q4_K || f == Format::Q6_K ? 256 : BLOCK; }

inline size_t row_bytes(Format f, int k) { return (size_t)(k / block_values(f)) * block_bytes(f); }

// About the bytes 32 weights take (for prefetching: no value depends on it).
inline int sub_bytes(Format f) { return (block_bytes(f) * BLOCK + block_values(f) - 1) / block_values(f); }

// Where the 32 weights b (0 .. k / 32 - 1) of a weight row start: the block, or the super-block
// that holds them (the decoders take the sub-block's index from b).
inline const uint8_t* block_at(Format f, const uint8_t* row, int b) {
  return block_values(f) == BLOCK ? row + (size_t)b * block_bytes(f) : row + (size_t)(b >> 3) * block_bytes(f);
}

// Q4_K's 6-bit scale and minimum of sub-block j (0..7) from its 12 packed bytes.
inline void q4_k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A K-quant super-block's per-sub-block factors, unpacked once for its 8 sub-blocks (the one-row
// loops read them from here): Q4_K's d * sc in a[0..7] and dmin * m in a[8..15]; Q6_K's d * sc of
// each 16 weights in a[0..15].  The products are gguf's (a float16 times a small integer: exact).
struct KScales {
  float a[16];
};

// Q4_K's eight 6-bit sc then eight m, one byte each, from the 12 packed bytes (q4_k_scale_min's
// unpacking, four sub-blocks at a time).
inline void q4_k_unpack(const uint8_t* s, uint8_t* out) {
  auto word = [s](int i) {
    return (uint32_t)s[i] | (uint32_t)s[i + 1] << 8 | (uint32_t)s[i + 2] << 16 | (uint32_t)s[i + 3] << 24;
  };
  const uint32_t u0 = word(0), u1 = word(4), u2 = word(8);
  const uint32_t w[4] = {u0 & 0x3f3f3f3fu, (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4),
                         u1 & 0x3f3f3f3fu, ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)};
  for (int i = 0; i < 16; ++i) out[i] = (uint8_t)(w[i >> 2] >> (8 * (i & 3)));
}

// d and dmin are the super-block's float16 fields as floats (any exact conversion).
inline void q4_k_scales(const uint8_t* s, float d, float dmin, KScales& ks) {
  uint8_t u[16];
  q4_k_unpack(s, u);
  for (int j = 0; j < 8; ++j) {
    ks.a[j] = d * (float)u[j];
    ks.a[8 + j] = dmin * (float)u[8 + j];
  }
}

inline void q6_k_scales(const uint8_t* blk, float d, KScales& ks) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  for (int i = 0; i < 16; ++i) ks.a[i] = d * (float)sc[i];
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

// The 32 weights b of a weight row to floats, portably (the reference the vector decoders equal bit
// for bit).
inline void decode_portable(Format f, const uint8_t* row, int b, float* w) {
  const uint8_t* blk = block_at(f, row, b);
  if (f == Format::Q4_K) {
    int sc, mn;
    q4_k_scale_min(blk + 4, b & 7, sc, mn);
    const float D = half_to_float(blk) * (float)sc, M = half_to_float(blk + 2) * (float)mn;
    const uint8_t* q = blk + 16 + 32 * ((b & 7) >> 1);
    const int shift = 4 * (b & 1);
    for (int i = 0; i < 32; ++i) w[i] = D * (float)((q[i] >> shift) & 0x0f) - M;
    return;
  }
  if (f == Format::Q6_K) {
    const int half = (b & 7) >> 2, j = b & 3;
    const uint8_t* ql = blk + 64 * half + 32 * (j & 1);
    const uint8_t* qh = blk + 128 + 32 * half;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * half + 2 * j;
    const float d = half_to_float(blk + 208);
    for (int i = 0; i < 32; ++i) {
      int q = ((ql[i] >> (j & 2 ? 4 : 0)) & 0x0f) | (((qh[i] >> (2 * j)) & 3) << 4);
      w[i] = (d * (float)sc[i >> 4]) * (float)(q - 32);
    }
    return;
  }
  float d = half_to_float(blk);
  if (f == Format::Q5_0) {
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    const uint8_t* q = blk + 6;
    for (int i = 0; i < 16; ++i) {
      w[i] = d * (float)((int)((q[i] & 0x0f) | (((qh >> i) & 1) << 4)) - 16);
      w[i + 16] = d * (float)((int)((q[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
    }
  } else if (f == Format::Q8_0) {
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

  Job from(int j) const {  // the same job from column j on
    Job rest = *this;
    rest.j0 = j;
    return rest;
  }
};

// Software prefetch for the few-row paths, whose columns are read in groups of C whole weight rows,
// one after the next: while block b of a group is computed, the same share of the group PREFETCH
// groups ahead is requested.  The hardware's own prefetch alone leaves a one-row product waiting
// on memory (Q8_0 read 4 GB/s from memory against 16 from cache on one core); this keeps several
// groups' lines in flight.  Prefetches change no value.
constexpr int PREFETCH = 3;

inline void prefetch_group(const Job& job, int j, int C, size_t row_bytes, int b, int bb) {
#ifdef QK_X86
  const int ahead = j + C * PREFETCH;
  if (ahead + C > job.n) return;  // past the share, into another thread's: the lines it will read
  const char* at = reinterpret_cast<const char*>(job.W + (size_t)ahead * row_bytes + (size_t)b * C * bb);
  for (int off = 0; off < C * bb; off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
#else
  (void)job, (void)j, (void)C, (void)row_bytes, (void)b, (void)bb;
#endif
}

#ifdef QK_X86
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
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

}  // namespace qk
