// Quantized linear layers, out[m, n] = x[m, k] @ dequant(W)[n, k].T in float32: the formats, the
// reference block decoder, a thread's job and the choice of instruction set.  The loops are in
// loops.h, written once against simd.h's traits; kernels.h compiles them per instruction set.
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
// A few rows skip the buffer: each block goes from its decoding straight to the rows' sums
// (one row; with AVX-512, up to 4).
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
constexpr int TILE_ROWS = 4;   // rows of x a tile of the decoded panel takes at a time

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
  if (ahead + C > job.j1) return;
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
