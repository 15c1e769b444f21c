// The int8-activation loops (kernels_i8.h says what they compute), written once and compiled once
// per instruction set: kernels_i8.h includes this file with QK_I8_ISA naming the set (I8Portable,
// I8Avx2, I8Vnni512) and QK_I8_TARGET its target attribute.  No include guard: that is the point.
//
// A call: the rows go in chunks of ROW_CHUNK, quantized once per chunk; the columns a group of C
// at a time, each group's weight pairs decoded once into a small panel (integers and factors) that
// every row of the chunk then meets, TR rows at a time, their accumulators in registers.

template <>
struct KernelsI8<QK_I8_ISA> {
  // Columns a group takes, and rows a tile: AVX2's 16 registers hold the accumulators of 2 rows x 2
  // columns (16 lanes: two vectors each), AVX-512's 32 those of 4 x 4 (one vector each)
  static constexpr int C = QK_I8_VNNI ? 4 : 2;
  static constexpr int TR = QK_I8_AVX2 ? 2 : TILE_ROWS;

#if QK_I8_VNNI
  // ---------------------------------------------------------------- AVX512-VNNI pieces
  QK_I8_TARGET static QK_INL __m512 halves(float a, float b) {
    return _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b));
  }
  QK_I8_TARGET static QK_INL __m512i join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  // ks: the super-block's factors (Q4_K; Avx512::k_scales, once per super-block)
  template <Format F>
  QK_I8_TARGET static QK_INL void w_pair_vnni(const uint8_t* row, int nb, int p, const KScales& ks, WPair& w) {
    if constexpr (F == Format::Q4_K) {
      const uint8_t* blk = row + (size_t)(p >> 2) * block_bytes(F);
      const int t = p & 3;
      __m256i u[2];
      q4k_pair_bytes(blk, t, u);
      _mm512_store_si512(w.u, join(u[0], u[1]));
      _mm512_store_ps(w.dw, halves(ks.a[2 * t], ks.a[2 * t + 1]));
      _mm512_store_ps(w.mv, halves(-ks.a[8 + 2 * t], -ks.a[9 + 2 * t]));
    } else if constexpr (F == Format::Q6_K) {
      const uint8_t* blk = row + (size_t)(p >> 2) * block_bytes(F);
      const int t = p & 3;
      __m256i q[2];
      q6k_pair_bytes(blk, t, q);
      _mm512_store_si512(w.u, join(q[0], q[1]));
      const __m128 sc = q6k_pair_scales(blk, t);
      const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
      _mm512_store_ps(w.dw, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(sc)));
      _mm512_store_ps(w.mv, _mm512_setzero_ps());
    } else {
      const uint8_t* b0 = row + (size_t)(2 * p) * block_bytes(F);
      const bool two = 2 * p + 1 < nb;
      __m256i v[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      float d[2] = {0.0f, 0.0f}, m[2] = {0.0f, 0.0f};
      for (int h = 0; h < 1 + two; ++h) {
        const uint8_t* blk = b0 + h * block_bytes(F);
        d[h] = load_half(blk);
        if constexpr (F == Format::Q8_0) {
          v[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), _mm256_set1_epi8((char)0x80));
        } else if constexpr (F == Format::Q5_0) {
          uint32_t qh;
          std::memcpy(&qh, blk + 2, 4);
          const __m256i n = i8_nibbles(blk + 6);
          v[h] = _mm256_mask_add_epi8(n, (__mmask32)qh, n, _mm256_set1_epi8(16));
        } else if constexpr (F == Format::Q4_1) {
          v[h] = i8_nibbles(blk + 4);
          m[h] = load_half(blk + 2);
        } else {
          v[h] = i8_nibbles(blk + 2);
        }
      }
      _mm512_store_si512(w.u, join(v[0], v[1]));
      _mm512_store_ps(w.dw, halves(d[0], d[1]));
      _mm512_store_ps(w.mv, halves(m[0], m[1]));
    }
  }

  QK_I8_TARGET static void quantize_rows_vnni(const float* x, int m, int k, int off, XPair* xp) {
    const int nb = k / BLOCK, np = (nb + 1) / 2;
    const __m512i ones = _mm512_set1_epi8(1), noff = _mm512_set1_epi32(-off);
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int r = 0; r < m; ++r)
      for (int p = 0; p < np; ++p) {
        XPair& o = xp[(size_t)r * np + p];
        float dx[2] = {0.0f, 0.0f};
        __m128i q[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
        for (int h = 0; h < 2 && 2 * p + h < nb; ++h) {
          const float* v = x + (size_t)r * k + (size_t)(2 * p + h) * BLOCK;
          const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
          const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
          float id;
          x_scale(amax, dx[h], id);
          const __m512 s = _mm512_set1_ps(id);
          q[2 * h] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, s)));
          q[2 * h + 1] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, s)));
        }
        const __m512i qv = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set_m128i(q[1], q[0])), _mm256_set_m128i(q[3], q[2]), 1);
        _mm512_store_si512(o.q, qv);
        const __m512i y = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, qv);
        _mm512_store_si512(o.nyo, _mm512_mullo_epi32(y, noff));
        const __m512 d = halves(dx[0], dx[1]);
        _mm512_store_ps(o.dx, d);
        _mm512_store_ps(o.sx, _mm512_mul_ps(d, _mm512_cvtepi32_ps(y)));
      }
  }
#endif

#if QK_I8_AVX2
  // ---------------------------------------------------------------- AVX2 pieces
  // Lanes 0-7 of a pair (its first block) are one vector, lanes 8-15 (the second) another.  Four
  // u * q to one int32 lane: maddubs (unsigned u times signed q, pairs summed to int16) and madd by
  // ones (pairs of those to int32).  maddubs saturates past 32,767: u < 64 (every format but Q8_0)
  // keeps a pair's sum within 2 * 63 * 127; Q8_0 keeps its weights signed (w = u - 128, stored as the
  // block's own bytes) and multiplies |w| by q with w's sign, at most 2 * 128 * 127, and its sum of
  // w * q is the contract's -128 * Y + sum(u * q).
  QK_I8_TARGET static QK_INL void put_pair(WPair& w, __m256i u0, __m256i u1, __m256 d0, __m256 d1, __m256 m0, __m256 m1) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(w.u), u0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w.u + 32), u1);
    _mm256_store_ps(w.dw, d0);
    _mm256_store_ps(w.dw + 8, d1);
    _mm256_store_ps(w.mv, m0);
    _mm256_store_ps(w.mv + 8, m1);
  }

  // ks: the super-block's factors (Q4_K; Avx2::k_scales, once per super-block).  Q8_0's u are the
  // block's signed bytes (see above); every other format's are w_pair_portable's.
  template <Format F>
  QK_I8_TARGET static QK_INL void w_pair_avx2(const uint8_t* row, int nb, int p, const KScales& ks, WPair& w) {
    if constexpr (F == Format::Q4_K) {
      const uint8_t* blk = row + (size_t)(p >> 2) * block_bytes(F);
      const int t = p & 3;
      __m256i u[2];
      q4k_pair_bytes(blk, t, u);
      put_pair(w, u[0], u[1], _mm256_set1_ps(ks.a[2 * t]), _mm256_set1_ps(ks.a[2 * t + 1]),
               _mm256_set1_ps(-ks.a[8 + 2 * t]), _mm256_set1_ps(-ks.a[9 + 2 * t]));
    } else if constexpr (F == Format::Q6_K) {
      const uint8_t* blk = row + (size_t)(p >> 2) * block_bytes(F);
      const int t = p & 3;
      __m256i q[2];
      q6k_pair_bytes(blk, t, q);
      const __m256 sc = _mm256_castps128_ps256(q6k_pair_scales(blk, t));
      put_pair(w, q[0], q[1], _mm256_permutevar8x32_ps(sc, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
               _mm256_permutevar8x32_ps(sc, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), _mm256_setzero_ps(),
               _mm256_setzero_ps());
    } else {
      const uint8_t* b0 = row + (size_t)(2 * p) * block_bytes(F);
      const bool two = 2 * p + 1 < nb;
      __m256i v[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      float d[2] = {0.0f, 0.0f}, m[2] = {0.0f, 0.0f};
      for (int h = 0; h < 1 + two; ++h) {
        const uint8_t* blk = b0 + h * block_bytes(F);
        d[h] = load_half(blk);
        if constexpr (F == Format::Q8_0) {
          v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        } else if constexpr (F == Format::Q5_0) {
          uint32_t qh;
          std::memcpy(&qh, blk + 2, 4);
          v[h] = _mm256_or_si256(i8_nibbles(blk + 6), _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)));
        } else if constexpr (F == Format::Q4_1) {
          v[h] = i8_nibbles(blk + 4);
          m[h] = load_half(blk + 2);
        } else {
          v[h] = i8_nibbles(blk + 2);
        }
      }
      put_pair(w, v[0], v[1], _mm256_set1_ps(d[0]), _mm256_set1_ps(d[1]), _mm256_set1_ps(m[0]), _mm256_set1_ps(m[1]));
    }
  }

  QK_I8_TARGET static void quantize_rows_avx2(const float* x, int m, int k, int off, XPair* xp) {
    const int nb = k / BLOCK, np = (nb + 1) / 2;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1), noff = _mm256_set1_epi32(-off);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lane-wise order back to 0..31
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int r = 0; r < m; ++r)
      for (int p = 0; p < np; ++p) {
        XPair& o = xp[(size_t)r * np + p];
        for (int h = 0; h < 2; ++h) {
          __m256i q = _mm256_setzero_si256();
          float dx = 0.0f;
          if (2 * p + h < nb) {
            const float* v = x + (size_t)r * k + (size_t)(2 * p + h) * BLOCK;
            __m256 a[4];
            for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(v + 8 * i);
            const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a[0], sign), _mm256_and_ps(a[1], sign)),
                                             _mm256_max_ps(_mm256_and_ps(a[2], sign), _mm256_and_ps(a[3], sign)));
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
            float id;
            x_scale(_mm_cvtss_f32(t), dx, id);
            const __m256 s = _mm256_set1_ps(id);
            __m256i i[4];
            for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], s));
            q = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), order);
          }
          _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 32 * h), q);
          const __m256i y = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
          _mm256_store_si256(reinterpret_cast<__m256i*>(o.nyo + 8 * h), _mm256_mullo_epi32(y, noff));
          const __m256 d = _mm256_set1_ps(dx);
          _mm256_store_ps(o.dx + 8 * h, d);
          _mm256_store_ps(o.sx + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(y)));
        }
      }
  }
#endif

  // R rows x C columns over every pair: get(p) gives pair p's C weight pairs, x rows' pairs at xr[r]
  template <int R, Format F, class Get>
  QK_I8_TARGET static QK_INL void tile(Get&& get, const XPair* const* xr, int np, float* out, int n) {
    constexpr bool MIN = format_has_min(F);
#if QK_I8_AVX2
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 acc[R][C][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int p = 0; p < np; ++p) {
      const WPair* w = get(p);
      for (int r = 0; r < R; ++r) {
        const XPair& x = xr[r][p];
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.q + 32 * h));
          const __m256 dx = _mm256_load_ps(x.dx + 8 * h);
          for (int c = 0; c < C; ++c) {
            const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[c].u + 32 * h));
            __m256i i;
            if constexpr (F == Format::Q8_0) {
              i = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(q, u)), ones16);
            } else {
              i = _mm256_add_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(x.nyo + 8 * h)),
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones16));
            }
            acc[r][c][h] = _mm256_add_ps(acc[r][c][h],
                                         _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(_mm256_load_ps(w[c].dw + 8 * h), dx)));
            if constexpr (MIN)
              acc[r][c][h] = _mm256_add_ps(acc[r][c][h], _mm256_mul_ps(_mm256_load_ps(w[c].mv + 8 * h), _mm256_load_ps(x.sx + 8 * h)));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)  // the 16 lanes in Avx512::reduce's tree: lanes i and i + 8 first
      for (int c = 0; c < C; ++c) out[(size_t)r * n + c] = Avx2::reduce(_mm256_add_ps(acc[r][c][0], acc[r][c][1]));
#elif QK_I8_VNNI
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < np; ++p) {
      const WPair* w = get(p);
      __m512i u[C];
      for (int c = 0; c < C; ++c) u[c] = _mm512_load_si512(w[c].u);
      for (int r = 0; r < R; ++r) {
        const XPair& x = xr[r][p];
        const __m512i q = _mm512_load_si512(x.q), nyo = _mm512_load_si512(x.nyo);
        const __m512 dx = _mm512_load_ps(x.dx);
        for (int c = 0; c < C; ++c) {
          const __m512i i = _mm512_dpbusd_epi32(nyo, u[c], q);
          acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(_mm512_load_ps(w[c].dw), dx)));
          if constexpr (MIN) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(_mm512_load_ps(w[c].mv), _mm512_load_ps(x.sx)));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[(size_t)r * n + c] = Avx512::reduce(acc[r][c]);
#else
    float acc[R][C][16] = {};
    for (int p = 0; p < np; ++p) {
      const WPair* w = get(p);
      for (int r = 0; r < R; ++r) {
        const XPair& x = xr[r][p];
        for (int c = 0; c < C; ++c)
          for (int l = 0; l < 16; ++l) {
            int32_t i = x.nyo[l];
            for (int e = 4 * l; e < 4 * l + 4; ++e) i += (int32_t)w[c].u[e] * (int32_t)x.q[e];
            acc[r][c][l] = acc[r][c][l] + (float)i * (w[c].dw[l] * x.dx[l]);
            if constexpr (MIN) acc[r][c][l] = acc[r][c][l] + w[c].mv[l] * x.sx[l];
          }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[(size_t)r * n + c] = reduce16_portable(acc[r][c]);
#endif
  }

  template <Format F>
  QK_I8_TARGET static QK_INL void w_pair(const uint8_t* row, int nb, int p, KScales& ks, WPair& w) {
#if QK_I8_AVX2
    if constexpr (F == Format::Q4_K) {
      if ((p & 3) == 0) Avx2::k_scales<F>(row + (size_t)(p >> 2) * block_bytes(F), ks);
    }
    w_pair_avx2<F>(row, nb, p, ks, w);
#elif QK_I8_VNNI
    if constexpr (F == Format::Q4_K) {
      if ((p & 3) == 0) Avx512::k_scales<F>(row + (size_t)(p >> 2) * block_bytes(F), ks);
    }
    w_pair_vnni<F>(row, nb, p, ks, w);
#else
    (void)ks;
    w_pair_portable(F, row, nb, p, w);
#endif
  }

  QK_I8_TARGET static void quantize_rows(const float* x, int m, int k, int off, XPair* xp) {
#if QK_I8_AVX2
    quantize_rows_avx2(x, m, k, off, xp);
#elif QK_I8_VNNI
    quantize_rows_vnni(x, m, k, off, xp);
#else
    quantize_rows_portable(x, m, k, off, xp);
#endif
  }

  // Rows [0, m) of the chunk, columns [j0, j1), the group of CC columns at j decoded into wp
  template <Format F, int CC>
  QK_I8_TARGET static void group(const Job& job, int j, const XPair* xp, int np, WPair* wp) {
    const int nb = job.k / BLOCK;
    const size_t rb = qk::row_bytes(F, job.k);
    // Q8_0 at up to a tile's rows, Q4_0 and Q5_0 at one: each pair decoded and used at once, no panel
    // (what measured faster; the same values either way)
    const int direct_rows = F == Format::Q8_0 ? TR : F == Format::Q4_0 || F == Format::Q5_0 ? 1 : 0;
    if (job.m <= direct_rows && CC == C) {
      KScales ks[C];
      alignas(64) WPair wl[C];
      auto direct = [&](int p) QK_I8_TARGET {
        for (int b = 2 * p; b < std::min(nb, 2 * p + 2); ++b) prefetch_group(job, j, C, rb, b, sub_bytes(F));
        for (int c = 0; c < C; ++c) w_pair<F>(job.W + (size_t)(j + c) * rb, nb, p, ks[c], wl[c]);
        return static_cast<const WPair*>(wl);
      };
      const XPair* xr[TR];
      for (int i = 0; i < job.m; ++i) xr[i] = xp + (size_t)i * np;
      float* out = job.out + j;
      if constexpr (TR >= 4) {
        if (job.m == 4) return tile<4, F>(direct, xr, np, out, job.n);
        if (job.m == 3) return tile<3, F>(direct, xr, np, out, job.n);
      }
      if (job.m == 2) return tile<2, F>(direct, xr, np, out, job.n);
      return tile<1, F>(direct, xr, np, out, job.n);
    }
    KScales ks[C];
    for (int p = 0; p < np; ++p) {
      for (int b = 2 * p; b < std::min(nb, 2 * p + 2); ++b) prefetch_group(job, j, CC, rb, b, sub_bytes(F));
      for (int c = 0; c < C; ++c) {
        if (c < CC) w_pair<F>(job.W + (size_t)(j + c) * rb, nb, p, ks[c], wp[(size_t)p * C + c]);
        else std::memset(&wp[(size_t)p * C + c], 0, sizeof(WPair));
      }
    }
    float part[TR * C];
    int r = 0;
    auto put = [&](int rows) {
      for (int i = 0; i < rows; ++i)
        for (int c = 0; c < CC; ++c) job.out[(size_t)(r + i) * job.n + j + c] = part[i * C + c];
    };
    auto panel = [wp](int p) { return wp + (size_t)p * C; };
    const XPair* xr[TR];
    for (; r + TR <= job.m; r += TR) {
      for (int i = 0; i < TR; ++i) xr[i] = xp + (size_t)(r + i) * np;
      tile<TR, F>(panel, xr, np, part, C);
      put(TR);
    }
    const int left = job.m - r;
    for (int i = 0; i < left; ++i) xr[i] = xp + (size_t)(r + i) * np;
    if (left == 0) return;
    if constexpr (TR >= 4) {
      if (left == 3) tile<3, F>(panel, xr, np, part, C);
      if (left == 2) tile<2, F>(panel, xr, np, part, C);
    }
    if (left == 1) tile<1, F>(panel, xr, np, part, C);
    put(left);
  }

  template <Format F>
  QK_I8_TARGET static void format_columns(const Job& job) {
    const int nb = job.k / BLOCK, np = (nb + 1) / 2;
    thread_local std::vector<XPair> xp;
    thread_local std::vector<WPair> wp;
    wp.resize((size_t)np * C);
    for (int r0 = 0; r0 < job.m; r0 += ROW_CHUNK) {
      Job part = job;
      part.x = job.x + (size_t)r0 * job.k;
      part.out = job.out + (size_t)r0 * job.n;
      part.m = std::min(ROW_CHUNK, job.m - r0);
      xp.resize((size_t)part.m * np);
      quantize_rows(part.x, part.m, job.k, format_offset(F), xp.data());
      int j = job.j0;
      for (; j + C <= job.j1; j += C) group<F, C>(part, j, xp.data(), np, wp.data());
      for (; j < job.j1; ++j) group<F, 1>(part, j, xp.data(), np, wp.data());
    }
  }

  QK_I8_TARGET static void columns(const Job& job) {
    switch (job.f) {
      case Format::Q8_0: return format_columns<Format::Q8_0>(job);
      case Format::Q4_0: return format_columns<Format::Q4_0>(job);
      case Format::Q4_1: return format_columns<Format::Q4_1>(job);
      case Format::Q5_0: return format_columns<Format::Q5_0>(job);
      case Format::Q4_K: return format_columns<Format::Q4_K>(job);
      case Format::Q6_K: return format_columns<Format::Q6_K>(job);
    }
  }
};
