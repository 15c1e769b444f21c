// The loops, written once against an instruction set's traits (simd.h) and compiled once per
// instruction set: kernels.h includes this file with QK_ISA naming the traits type and QK_TARGET
// its target attribute (GCC takes a target from an attribute, never from a template parameter).
// No include guard: that is the point.
//
// Products (qkernels.h says what they compute and the order of their sums): a panel of PANEL
// columns is decoded once and met by every row of x in tiles of TILE_ROWS rows; up to ROWS rows
// (WIDE_ROWS) skip the panel and meet each decoded block straight from registers, and up to twice
// PASS_ROWS go through those loops in two passes, with the same multiply-adds in the same order
// (the same sums, bit for bit).  A decode step's other loops (decode_ops.h) are plain C++ the
// compiler vectorizes for the target.

template <>
struct Kernels<QK_ISA> {
  using I = QK_ISA;
  using V = I::V;
  static constexpr int W = I::W, SLICES = BLOCK / I::W;

  // R rows x C columns against blocks [b0, b1) of a decoded panel wp ([nb][C][32] floats); x rows k
  // floats apart.  The accumulators start at zero (b0 == 0) or from `keep`, and end in `keep` or,
  // after the last block, reduced into out.
  template <int R, int C>
  QK_TARGET static void tile(const float* wp, const float* x, int k, int b0, int b1, float* keep, float* out, int n) {
    V acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = b0 == 0 ? I::zero() : I::load(keep + (r * C + c) * W);
    wp += (size_t)b0 * C * BLOCK;
    for (int b = b0; b < b1; ++b, wp += C * BLOCK) {
      for (int s = 0; s < SLICES; ++s) {
        V w[C];
        for (int c = 0; c < C; ++c) w[c] = I::load(wp + c * BLOCK + W * s);
        for (int r = 0; r < R; ++r) {
          V xv = I::load(x + (size_t)r * k + b * BLOCK + W * s);
          for (int c = 0; c < C; ++c) acc[r][c] = I::fma(w[c], xv, acc[r][c]);
        }
      }
    }
    if (b1 * BLOCK == k) {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[(size_t)r * n + c] = I::reduce(acc[r][c]);
    } else {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) I::store(keep + (r * C + c) * W, acc[r][c]);
    }
  }

  // Sub-blocks J .. 7 of super-block sb for rows<F, C, R> (K-quants): blk[c] is column c's
  // super-block, ks[c] its factors.  The same multiply-adds, in the same order, as the generic loop.
  template <Format F, int C, int R, int J>
  QK_TARGET static QK_INL void super_steps(const Job& job, const uint8_t* const* blk, const KScales* ks, int j,
                                           size_t row_bytes, int sb, V (&acc)[R][C]) {
    const int b = 8 * sb + J;
    V w[C][SLICES];
    for (int c = 0; c < C; ++c) I::template decode_sub<F, J>(blk[c], ks[c], w[c]);
    for (int s = 0; s < SLICES; ++s)
      for (int r = 0; r < R; ++r) {
        V xv = I::load(job.x + (size_t)r * job.k + b * BLOCK + W * s);
        for (int c = 0; c < C; ++c) acc[r][c] = I::fma(w[c][s], xv, acc[r][c]);
      }
    if constexpr (J < 7) super_steps<F, C, R, J + 1>(job, blk, ks, j, row_bytes, sb, acc);
  }

  // R rows (at most ROWS): each decoded block meets the rows of x straight from registers.  A
  // K-quant's factors are unpacked once per super-block, for its 8 sub-blocks.
  template <Format F, int C, int R>
  QK_TARGET static void rows(const Job& job) {
    if constexpr (block_values(F) != BLOCK) {
      const int ns = job.k / block_values(F);
      const size_t row_bytes = qk::row_bytes(F, job.k);
      int j = job.j0;
      for (; j + C <= job.j1; j += C) {
        V acc[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][c] = I::zero();
        for (int sb = 0; sb < ns; ++sb) {
          prefetch_group(job, j, C, row_bytes, sb, block_bytes(F));
          const uint8_t* blk[C];
          KScales ks[C];
          for (int c = 0; c < C; ++c) {
            blk[c] = job.W + (j + c) * row_bytes + (size_t)sb * block_bytes(F);
            I::template k_scales<F>(blk[c], ks[c]);
          }
          super_steps<F, C, R, 0>(job, blk, ks, j, row_bytes, sb, acc);
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) job.out[(size_t)r * job.n + j + c] = I::reduce(acc[r][c]);
      }
      if constexpr (C > 1) {
        if (j < job.j1) rows<F, 1, R>(job.from(j));  // the last columns, fewer than a panel
      }
      return;
    }
    const int nb = job.k / BLOCK, bb = sub_bytes(F);
    const size_t row_bytes = qk::row_bytes(F, job.k);
    int j = job.j0;
    for (; j + C <= job.j1; j += C) {
      V acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = I::zero();
      for (int b = 0; b < nb; ++b) {
        prefetch_group(job, j, C, row_bytes, b, bb);
        V w[C][SLICES];
        for (int c = 0; c < C; ++c) I::template decode<F>(job.W + (j + c) * row_bytes, b, w[c]);
        for (int s = 0; s < SLICES; ++s)
          for (int r = 0; r < R; ++r) {
            V xv = I::load(job.x + (size_t)r * job.k + b * BLOCK + W * s);
            for (int c = 0; c < C; ++c) acc[r][c] = I::fma(w[c][s], xv, acc[r][c]);
          }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) job.out[(size_t)r * job.n + j + c] = I::reduce(acc[r][c]);
    }
    if constexpr (C > 1) {
      if (j < job.j1) rows<F, 1, R>(job.from(j));  // the last columns, fewer than a panel
    }
  }

  static constexpr int PASS_ROWS = 8;  // rows a pass of the few-row loops takes, past WIDE_ROWS (panels)

  // Columns a block of R rows takes together: one row ROW_COLUMNS in the light formats below, C in
  // the others; up to ROWS rows C.  Past ROWS rows: formats whose block decodes in a
  // few instructions (Q4_0, Q4_1, Q8_0) keep all C up to LIGHT_ROWS rows (9 with AVX-512, 4 with
  // AVX2), though the accumulators spill: timed on Zen 4 and Zen 3, the spills cost less than
  // decoding each block for fewer columns at a time, where Q5_0's and the K-quants' heavier
  // decoding does not (docs/quantized-cpu.md, "A few sequences").  The others, and every format
  // past LIGHT_ROWS, take as many of C as keep the R x C accumulators and the C decoded columns
  // (SLICES registers each) within all but 4 of the registers.  Only the columns taken together
  // change; each sum is the same.
  static constexpr int wide_columns(Format F, int C, int R) {
    const bool light = F == Format::Q4_0 || F == Format::Q4_1 || F == Format::Q8_0;
    if (R == 1 && light) return I::ROW_COLUMNS;
    if (R <= I::ROWS) return C;
    return light && R <= I::LIGHT_ROWS ? C : std::max(1, std::min(C, (I::REGISTERS - 4) / (R + SLICES)));
  }

  // job.m rows, R <= job.m <= TOP, by rows<F, C (fewer past ROWS rows), job.m>
  template <Format F, int C, int R = 1, int TOP = I::ROWS>
  QK_TARGET static void few_rows(const Job& job) {
    if constexpr (R < TOP) {
      if (job.m != R) return few_rows<F, C, R + 1, TOP>(job);
    }
    rows<F, wide_columns(F, C, R), R>(job);
  }

  // Sub-blocks J .. 7 of a K-quant super-block (its factors ks) decoded into a panel of C columns,
  // sub-block J at to + J * C * BLOCK: the weights decode<F> gives.
  template <Format F, int C, int J>
  QK_TARGET static QK_INL void decode_super(const uint8_t* blk, const KScales& ks, float* to) {
    V w[SLICES];
    I::template decode_sub<F, J>(blk, ks, w);
    for (int s = 0; s < SLICES; ++s) I::store(to + J * C * BLOCK + W * s, w[s]);
    if constexpr (J < 7) decode_super<F, C, J + 1>(blk, ks, to);
  }

  // Columns [j0, j1) a panel of C at a time: the panel decoded once, then k in chunks of at most
  // K_CHUNK_BYTES of decoded panel (the whole of k where it fits) so that a chunk of the panel and
  // of TILE_ROWS rows of x stay in L1 while the rows go by.  (A software prefetch of the next
  // panel's weights, a part per row tile, measured no faster: the hardware's keeps up here.)
  template <Format F, int C>
  QK_TARGET static void panels(const Job& job, std::vector<float>& buf) {
    if (job.m <= I::ROWS) return few_rows<F, C>(job);
    if constexpr (I::WIDE_ROWS > I::ROWS) {
      // a few rows more: each block still decoded once into registers (the compiler keeps what
      // does not fit on the stack: cheaper than the decoded panel below, which reads its weights
      // back from memory without the prefetch)
      if (job.m <= I::WIDE_ROWS) return few_rows<F, C, I::ROWS + 1, I::WIDE_ROWS>(job);
      if (job.m <= 2 * PASS_ROWS) {
        // 13 to 16 rows: two passes of the few-row loops, PASS_ROWS rows and then the rest.  Each
        // block is decoded twice, which still costs less than the panel at these counts (the tied
        // head's 49,152 columns most: docs/quantized-cpu.md, "A few sequences")
        Job first = job, rest = job;
        first.m = PASS_ROWS;
        rest.m = job.m - PASS_ROWS;
        rest.x += (size_t)PASS_ROWS * job.k;
        rest.out += (size_t)PASS_ROWS * job.n;
        panels<F, C>(first, buf);
        return panels<F, C>(rest, buf);
      }
    }
    const int nb = job.k / BLOCK, k = job.k;
    const int most = std::max(1, K_CHUNK_BYTES / (C * BLOCK * (int)sizeof(float)));
    const int chunks = (nb + most - 1) / most, chunk = (nb + chunks - 1) / chunks;
    const size_t row_bytes = qk::row_bytes(F, job.k);
    buf.resize((size_t)k * C + (size_t)job.m * C * W);
    float* wp = buf.data();
    float* keep = wp + (size_t)k * C;
    int j = job.j0;
    for (; j + C <= job.j1; j += C) {
      if constexpr (block_values(F) != BLOCK) {  // a K-quant's factors unpacked once per super-block
        for (int sb = 0; sb < nb / 8; ++sb)
          for (int c = 0; c < C; ++c) {
            const uint8_t* blk = job.W + (j + c) * row_bytes + (size_t)sb * block_bytes(F);
            KScales ks;
            I::template k_scales<F>(blk, ks);
            decode_super<F, C, 0>(blk, ks, wp + (size_t)(8 * sb * C + c) * BLOCK);
          }
      } else {
        for (int b = 0; b < nb; ++b)
          for (int c = 0; c < C; ++c) {
            V w[SLICES];
            I::template decode<F>(job.W + (j + c) * row_bytes, b, w);
            for (int s = 0; s < SLICES; ++s) I::store(wp + (b * C + c) * BLOCK + W * s, w[s]);
          }
      }
      for (int b0 = 0; b0 < nb; b0 += chunk) {
        const int b1 = std::min(nb, b0 + chunk);
        int r = 0;
        for (; r + TILE_ROWS <= job.m; r += TILE_ROWS)
          tile<TILE_ROWS, C>(wp, job.x + (size_t)r * k, k, b0, b1, keep + (size_t)r * C * W,
                             job.out + (size_t)r * job.n + j, job.n);
        for (; r < job.m; ++r)
          tile<1, C>(wp, job.x + (size_t)r * k, k, b0, b1, keep + (size_t)r * C * W, job.out + (size_t)r * job.n + j,
                     job.n);
      }
    }
    if constexpr (C > 1) {
      if (j < job.j1) panels<F, 1>(job.from(j), buf);  // the last columns, fewer than a panel
    }
  }

  // ---------------------------------------------------------------- entry points

  QK_TARGET static void columns(const Job& job, std::vector<float>& buf) {
    switch (job.f) {
      case Format::Q8_0: return panels<Format::Q8_0, I::PANEL>(job, buf);
      case Format::Q4_0: return panels<Format::Q4_0, I::PANEL>(job, buf);
      case Format::Q4_1: return panels<Format::Q4_1, I::PANEL>(job, buf);
      case Format::Q5_0: return panels<Format::Q5_0, I::PANEL>(job, buf);
      case Format::Q4_K: return panels<Format::Q4_K, I::PANEL>(job, buf);
      case Format::Q6_K: return panels<Format::Q6_K, I::PANEL>(job, buf);
    }
  }
  QK_TARGET static void attend_units(const AttendJob& j, int split, int u0, int u1) {
    attend_units_body<I>(j, split, u0, u1);
  }
  QK_TARGET static void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int n, float eps) {
    rms_norm_body(x, w, y, rows, n, eps);
  }
  QK_TARGET static void gated_rows(const float* gu, float* y, int64_t rows, int n, int gelu) {
    gated_body(gu, y, rows, n, gelu);
  }
  QK_TARGET static void rope_rows(const float* x, const float* cs, const float* sn, float* y, int B, int H, int D,
                                  int half, bool per_row) {
    rope_body(x, cs, sn, y, B, H, D, half, per_row);
  }
};
