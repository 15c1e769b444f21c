// Loops for the parts of a decode step around its products, each one MLX node where MLX's own ops
// take five to thirty-five: RMSNorm, rope applied from a step's tables, and attention of one new
// token per row over K/V kept in pool blocks.  At one row a step's cost is MLX's cost per node,
// not arithmetic (docs/quantized-cpu.md, "Where a one-sequence step goes").
//
// Each loop computes a row from that row's inputs alone, in an order fixed by the code: the same
// result for a row alone as in any batch.  The bodies are plain C++ written so the compiler
// vectorizes them (lane arrays instead of reductions, no libm calls in the loops); kernels.h
// compiles them once per instruction set, as it does the products, and runs the one qk::isa() names.
// Attention's inner loops (a block's scores, its values' weighted sums, its q8_0 rows) are
// attend_simd.h's, written with each instruction set's intrinsics where it has them, and adding
// exactly what the plain loops add, in their order: the same bits in every loop set.
//
// K/V in q8_0 blocks (slotinfer/kv/quant.py: per 32 values of a token's head vector, a float16 scale
// d and 32 int8 q, the value d * q) are read a block at a time: the block's key or value rows that
// are needed are dequantized into floats (d * q, one rounding) just before their dot products or
// weighted sums, which then run as over float pools, so the result is bit for bit the float loops'
// over the dequantized pools.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attend_simd.h"
#include "qkernels.h"

namespace qk {

// e ** x as slotinfer.cpu.fastmath.exp computes it: x = k ln 2 + r, |r| <= ln 2 / 2, and 2^k from
// the exponent bits (0 where 2^k would be 2^-126 or less, so -inf gives exactly 0).  The polynomial
// in r follows, in the form fastmath uses for the caller: Estrin's (softmax) or Horner's (MLP).
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

QK_INLINE float exp_reduce(float x, float& r) {
  const float log2e = 1.44269504088896341f, round = 12582912.0f, hi = 0.693359375f, lo = -2.12194440e-4f;
  float c = std::min(std::max(x, -87.0f), 88.0f);
  float k = (c * log2e + round) - round;
  r = (c - k * hi) - k * lo;
  int32_t bits = k < -125.5f ? 0 : ((int32_t)k + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, 4);
  return two_k;
}

// e ** x elementwise in place, Estrin's form (the softmax's)
QK_INLINE void exp_inplace(float* x, int n) {
  const float* P = EXP_P;
  for (int i = 0; i < n; ++i) {
    float r;
    const float two_k = exp_reduce(x[i], r);
    float r2 = r * r;
    float p = ((P[0] * r + P[1]) * r2 + (P[2] * r + P[3])) * r2 + (P[4] * r + P[5]);
    x[i] = (p * r2 + r + 1.0f) * two_k;
  }
}

// e ** x, Horner's form (the MLP's activations)
QK_INLINE float exp_horner(float x) {
  float r;
  const float two_k = exp_reduce(x, r);
  float p = EXP_P[0];
  for (int i = 1; i < 6; ++i) p = p * r + EXP_P[i];
  return (p * (r * r) + r + 1.0f) * two_k;
}

struct AttendJob {
  const float* q;          // [B, H, D], rows q_stride floats apart
  int64_t q_stride;        // 0: H * D
  const float* keys;       // pool [num_blocks, kvh, bs, D]
  const float* values;
  const uint8_t* keys8;    // or q8_0 pools [num_blocks, kvh, bs, D / 32 * 34] (then keys, values are null)
  const uint8_t* values8;
  const int32_t* tables;   // [B, nblk]
  const bool* mask;        // [B or 1, span] (nullptr: every position)
  bool mask_per_row;
  float* out;              // [B, H, D]
  int B, H, kvh, bs, D, nblk;
  float scale;             // q's factor (applied first, rounded: (q * scale) . k)
  float softcap;           // 0: none
};

// The largest of n scores as a scan in order finds it (top = max(top, s_i) from -inf: a NaN is never
// taken, and of equal scores the first stays), in 16 lanes so that it vectorizes: equal scores are
// the same bits but for zeros, so a zero maximum is the first zero in order (its sign).
QK_INLINE float scores_max(const float* s, int n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float lanes[16];
  for (int l = 0; l < 16; ++l) lanes[l] = ninf;
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], s[i + l]);
  float top = ninf;
  for (int l = 0; l < 16; ++l) top = std::max(top, lanes[l]);
  for (; i < n; ++i) top = std::max(top, s[i]);
  if (top == 0.0f)
    for (i = 0; i < n; ++i)
      if (s[i] == 0.0f) return s[i];
  return top;
}

// A head's scores s (span of them) to e = exp(s - max) in place; false where every score is -inf
QK_INLINE bool softmax_weights(float* s, int span) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float top = scores_max(s, span);
  if (top == ninf) return false;
  for (int i = 0; i < span; ++i) s[i] -= top;
  exp_inplace(s, span);
  return true;
}

// The weighted sums of values of the rep heads h0 .. of row b, K/V head g, from their weights (rep
// rows of span in `scores`, from softmax_weights; live: whether a head has any), a block at a time
// (ValueSums), each head's over positions in order; out = sums / total, or zeros where not live.
// q8_0 pools: a block's rows that some head weighs are dequantized once for all the heads (into
// `rows`, bs * D floats; need: bs bytes).
template <class I, int DC>
QK_INLINE void attend_values(const AttendJob& j, int b, int g, int h0, int rep, const int32_t* table,
                             const float* scores, const uint8_t* live, float* rows, uint8_t* need, float* acc,
                             float* sums) {
  const int span = j.nblk * j.bs, D = DC ? DC : j.D;
  const bool q8 = j.values8 != nullptr;
  const size_t rb = q8 ? q8_row_bytes(D) : 0;
  for (int r = 0; r < rep; ++r) {
    sums[r] = 0.0f;
    for (int d = 0; d < D; ++d) acc[(size_t)r * D + d] = 0.0f;
  }
  for (int t = 0; t < j.nblk; ++t) {
    const size_t first = ((size_t)table[t] * j.kvh + g) * j.bs;  // the block's first row
    const float* vb = q8 ? rows : j.values + first * D;
    if (q8) {  // the block's values that some head weighs, dequantized
      for (int p = 0; p < j.bs; ++p) {
        bool used = false;
        for (int r = 0; r < rep; ++r) used |= live[r] && scores[(size_t)r * span + t * j.bs + p] != 0.0f;
        need[p] = used;
      }
      DequantRows<I>::run(j.values8 + first * rb, j.bs, D, need, rows);
    }
    ValueSums<I, DC>::run(scores + t * j.bs, span, rep, live, vb, j.bs, D, acc, sums);
  }
  for (int r = 0; r < rep; ++r) {
    float* o = j.out + ((size_t)b * j.H + h0 + r) * D;
    for (int d = 0; d < D; ++d) o[d] = live[r] ? acc[(size_t)r * D + d] / sums[r] : 0.0f;
  }
}

// Attention of row b's query heads r0 .. r1 - 1 of K/V head g (times scale) over its blocks, those
// heads together (each key read once for all of them): scores in position order, masked to -inf,
// soft-capped where asked; e = exp(s - max); out = (sum over positions in order of e_j * v_j) / sum
// of e_j, positions with e_j = 0 skipped (a masked or underflowed position adds nothing).  A head's
// values are the same whichever heads it goes with.  DC: the head size when it is known at compile
// time (the sums then stay in registers), else 0; I: the instruction set of the inner loops.
template <class I, int DC>
QK_INLINE void attend_heads(const AttendJob& j, int b, int g, int r0, int r1, std::vector<float>& buf) {
  const int span = j.nblk * j.bs, rep = r1 - r0, D = DC ? DC : j.D;
  const bool q8 = j.keys8 != nullptr;
  const size_t rb = q8 ? q8_row_bytes(D) : 0;
  // scores [rep, span], queries [rep, D], sums [rep, D], totals [rep], live [rep] (bytes, in floats'
  // room), and where q8_0 a block's rows dequantized [bs, D] and which of them are needed [bs] (bytes)
  buf.resize((size_t)rep * (span + 2 * D + 2) + (q8 ? (size_t)j.bs * (D + 1) : 0));
  float* q = buf.data() + (size_t)rep * span;  // the heads' scaled queries
  float* acc = q + (size_t)rep * D;
  float* sums = acc + (size_t)rep * D;
  uint8_t* live = reinterpret_cast<uint8_t*>(sums + rep);
  float* rows = sums + 2 * rep;
  const bool* m = j.mask ? j.mask + (j.mask_per_row ? (size_t)b * span : 0) : nullptr;
  const int32_t* table = j.tables + (size_t)b * j.nblk;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int h0 = g * (j.H / j.kvh) + r0;
  for (int r = 0; r < rep; ++r) {
    const float* qh = j.q + (size_t)b * (j.q_stride ? j.q_stride : (int64_t)j.H * D) + (size_t)(h0 + r) * D;
    for (int d = 0; d < D; ++d) q[r * D + d] = qh[d] * j.scale;
  }
  for (int t = 0; t < j.nblk; ++t) {
    const size_t first = ((size_t)table[t] * j.kvh + g) * j.bs;  // the block's first row
    const float* kb = q8 ? rows : j.keys + first * D;
    const bool* mb = m ? m + t * j.bs : nullptr;
    int lo = 0, hi = j.bs;  // the block's positions from the first shown to the last
    if (mb) {
      while (lo < hi && !mb[lo]) ++lo;
      while (hi > lo && !mb[hi - 1]) --hi;
    }
    if (q8 && lo < hi)  // the block's keys that some position shows, dequantized
      DequantRows<I>::run(j.keys8 + (first + lo) * rb, hi - lo, D, reinterpret_cast<const uint8_t*>(mb ? mb + lo : mb),
                          rows + (size_t)lo * D);
    float* s = buf.data() + t * j.bs;
    // the scores of the keys from the first shown to the last (a masked one's is not read: its row
    // may be stale where q8), then the mask
    if (lo < hi) KeyScores<I, DC>::run(q, rep, D, kb + (size_t)lo * D, hi - lo, s + lo, span);
    for (int p = 0; p < j.bs; ++p) {
      const bool on = !mb || mb[p];
      if (on && j.softcap == 0.0f) continue;
      for (int r = 0; r < rep; ++r) {
        float& v = s[(size_t)r * span + p];
        v = on ? std::tanh(v / j.softcap) * j.softcap : ninf;
      }
    }
  }
  for (int r = 0; r < rep; ++r) live[r] = softmax_weights(buf.data() + (size_t)r * span, span);
  uint8_t* need = reinterpret_cast<uint8_t*>(rows + (size_t)j.bs * D);
  attend_values<I, DC>(j, b, g, h0, rep, table, buf.data(), live, rows, need, acc, sums);
}

// Units [u0, u1) of an attention job of `split` units a K/V head: unit u is row u / (kvh split),
// K/V head (u / split) mod kvh, and the split-th part of that head's query heads (split divides
// H / kvh; 1: all of them together).
template <class I>
QK_INLINE void attend_units_body(const AttendJob& j, int split, int u0, int u1) {
  thread_local std::vector<float> s;
  const int per = j.H / j.kvh / split;
  for (int u = u0; u < u1; ++u) {
    const int part = u % split, g = (u / split) % j.kvh, b = u / split / j.kvh;
    const int r0 = part * per, r1 = r0 + per;
    switch (j.D) {
      case 64: attend_heads<I, 64>(j, b, g, r0, r1, s); break;
      case 128: attend_heads<I, 128>(j, b, g, r0, r1, s); break;
      case 256: attend_heads<I, 256>(j, b, g, r0, r1, s); break;
      default: attend_heads<I, 0>(j, b, g, r0, r1, s);
    }
  }
}

// Rows [b0, b1), each K/V head's query heads together
template <class I>
QK_INLINE void attend_rows_body(const AttendJob& j, int b0, int b1) { attend_units_body<I>(j, 1, b0 * j.kvh, b1 * j.kvh); }

// The gated activations of the MLP on rows of [gate | up] (each n wide) into y [rows, n]:
// silu(g) * u = (g / (1 + e^-g)) * u, or gelu_tanh(g) * u = sigmoid(2a) * g * u with
// a = sqrt(2 / pi) * (g + 0.044715 g^3), as slotinfer.cpu.ops computes them.
QK_INLINE void gated_body(const float* gu, float* y, int64_t rows, int n, int gelu) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * n;
    const float* u = g + n;
    float* yr = y + r * n;
    if (!gelu) {
      for (int i = 0; i < n; ++i) yr[i] = (g[i] / (1.0f + exp_horner(-g[i]))) * u[i];
    } else {
      const float c = 0.7978845608028654f;  // sqrt(2 / pi)
      for (int i = 0; i < n; ++i) {
        const float a = c * (g[i] + 0.044715f * g[i] * g[i] * g[i]);
        yr[i] = ((1.0f / (1.0f + exp_horner(-(2.0f * a)))) * g[i]) * u[i];
      }
    }
  }
}

// y = (x * (1 / sqrt(mean(x^2) + eps))) * w per row of n (w may be null)
QK_INLINE void rms_norm_body(const float* x, const float* w, float* y, int64_t rows, int n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    const float scale = 1.0f / std::sqrt(dot(xr, xr, n) / (float)n + eps);
    if (w) {
      for (int i = 0; i < n; ++i) yr[i] = (xr[i] * scale) * w[i];
    } else {
      for (int i = 0; i < n; ++i) yr[i] = xr[i] * scale;
    }
  }
}

// Rope from tables: per (row, head), the first `half` and next `half` features x1, x2 become
// x1 * cos - x2 * sin and x1 * sin + x2 * cos (each product rounded, as separate ops round them);
// features past 2 * half are copied.  cos/sin rows: one per batch row, or one for all.
QK_INLINE void rope_body(const float* x, const float* cs, const float* sn, float* y, int B, int H, int D, int half,
                         bool per_row) {
  for (int b = 0; b < B; ++b) {
    const float* c = cs + (per_row ? (size_t)b * half : 0);
    const float* s = sn + (per_row ? (size_t)b * half : 0);
    for (int h = 0; h < H; ++h) {
      const float* xr = x + ((size_t)b * H + h) * D;
      float* yr = y + ((size_t)b * H + h) * D;
      for (int i = 0; i < half; ++i) {
        const float x1 = xr[i], x2 = xr[i + half];
        yr[i] = x1 * c[i] - x2 * s[i];
        yr[i + half] = x1 * s[i] + x2 * c[i];
      }
      for (int i = 2 * half; i < D; ++i) yr[i] = xr[i];
    }
  }
}

}  // namespace qk
