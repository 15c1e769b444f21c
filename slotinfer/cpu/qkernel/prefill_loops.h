// The loops of prefill_attention.cpp, written once against an instruction set's traits (simd.h) and
// compiled once per instruction set: prefill_attention.cpp includes this file with QK_ISA naming the
// traits type and QK_TARGET its target attribute, as kernels.h does loops.h.  No include guard.
//
// One work item: row b, K/V head g, query positions [a0, a1) with all the group's query heads
// (rep of them): N = rep * (a1 - a0) query vectors, padded to a multiple of R.  For each key block:
//   scores  s[n][j] = sum over d in order of k[j][d] * qs[n][d]   (qs = q * scale, rounded)
//   then per query: soft-cap, mask to -inf, m' = max(m, max_j s), e_j = exp(s_j - m'),
//   a = exp(m - m') (1 where m' = m), l = l * a + (sum of e_j: 16 lanes, then a fixed tree),
//   o[n][d] = (sum over j in order of e_j * v[j][d]) + o[n][d] * a
// and at the end out = o / l.  Each query vector's arithmetic is its own: the micro-tiles only
// decide which of them share a register pass.

template <>
struct PrefillKernels<QK_ISA> {
  using I = QK_ISA;
  using V = I::V;
  static constexpr int W = I::W;
  static constexpr int R = W == 16 ? 8 : 3;  // query vectors per micro-tile
  static constexpr int NC = 32 / W;          // key vectors of a scores micro-tile (32 keys)

  // R query vectors (D apart) against the 32 keys at kt + c0 of a transposed block kt [D][KEY_BLOCK]
  QK_TARGET static QK_INL void scores(const float* qs, int D, const float* kt, int c0, float* s) {
    V acc[R][NC];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = I::zero();
    for (int d = 0; d < D; ++d) {
      V kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = I::load(kt + (size_t)d * KEY_BLOCK + c0 + c * W);
      for (int r = 0; r < R; ++r) {
        const V qb = splat(I{}, qs[(size_t)r * D + d]);
        for (int c = 0; c < NC; ++c) acc[r][c] = I::fma(kv[c], qb, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) I::store(s + (size_t)r * KEY_BLOCK + c0 + c * W, acc[r][c]);
  }

  // o[r][d0 .. d0 + CV * W) of R query vectors: the block's weighted values (nk keys, rows D apart)
  // plus o * a
  template <int CV>
  QK_TARGET static QK_INL void values(const float* p, const float* vb, int nk, int D, int d0, const float* a,
                                      float* o) {
    V acc[R][CV];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CV; ++c) acc[r][c] = I::zero();
    for (int j = 0; j < nk; ++j) {
      V vv[CV];
      for (int c = 0; c < CV; ++c) vv[c] = I::load(vb + (size_t)j * D + d0 + c * W);
      for (int r = 0; r < R; ++r) {
        const V pb = splat(I{}, p[(size_t)r * KEY_BLOCK + j]);
        for (int c = 0; c < CV; ++c) acc[r][c] = I::fma(vv[c], pb, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const V ab = splat(I{}, a[r]);
      for (int c = 0; c < CV; ++c) {
        float* at = o + (size_t)r * D + d0 + c * W;
        I::store(at, I::fma(I::load(at), ab, acc[r][c]));
      }
    }
  }

  // the max of a block's scores, and the sum of its weights: 16 lanes (lane l takes x = l mod 16),
  // then a fixed tree
  QK_TARGET static QK_INL float block_max(const float* s) {
    float m[16];
    for (int l = 0; l < 16; ++l) m[l] = s[l];
    for (int x = 16; x < KEY_BLOCK; x += 16)
      for (int l = 0; l < 16; ++l) m[l] = m[l] > s[x + l] ? m[l] : s[x + l];
    for (int w = 8; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) m[l] = m[l] > m[l + w] ? m[l] : m[l + w];
    return m[0];
  }
  QK_TARGET static QK_INL float block_sum(const float* s) {
    float a[16];
    for (int l = 0; l < 16; ++l) a[l] = s[l];
    for (int x = 16; x < KEY_BLOCK; x += 16)
      for (int l = 0; l < 16; ++l) a[l] += s[x + l];
    for (int w = 8; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) a[l] += a[l + w];
    return a[0];
  }

  QK_TARGET static void item(const PrefillJob& j, int b, int g, int a0, int a1, PrefillScratch& sc) {
    const int D = j.D, rep = j.H / j.kvh, T = a1 - a0, N = rep * T, NP = (N + R - 1) / R * R;
    const float ninf = -std::numeric_limits<float>::infinity();
    sc.qs.assign((size_t)NP * D, 0.0f);
    sc.o.assign((size_t)NP * D, 0.0f);
    sc.m.assign(NP, ninf);
    sc.l.assign(NP, 0.0f);
    sc.a.assign(NP, 1.0f);
    sc.kt.resize((size_t)D * KEY_BLOCK);
    sc.s.resize((size_t)NP * KEY_BLOCK);
    const bool q8 = j.keys8 != nullptr;  // q8_0 rows: a block of keys (and of values) dequantized as it is read
    const size_t rb = q8 ? q8_row_bytes(D) : 0;
    if (q8) {
      sc.row.resize(D);
      sc.vd.resize((size_t)KEY_BLOCK * D);
    }
    // query vector n = (i - a0) * rep + r: position i, head g * rep + r
    int lo = j.S, hi = 0;
    for (int i = a0; i < a1; ++i) {
      lo = std::min(lo, j.first[(size_t)j.mrow(b) * j.L + i]);
      hi = std::max(hi, j.last[(size_t)j.mrow(b) * j.L + i]);
      for (int r = 0; r < rep; ++r) {
        const float* qh = j.q + (((size_t)b * j.H + g * rep + r) * j.L + i) * D;
        float* dst = sc.qs.data() + ((size_t)(i - a0) * rep + r) * D;
        for (int d = 0; d < D; ++d) dst[d] = qh[d] * j.scale;
      }
    }
    const size_t head = ((size_t)b * j.kvh + g) * j.S;  // the head's first row
    const float* K = q8 ? nullptr : j.keys + head * D;
    const float* Vv = q8 ? nullptr : j.values + head * D;
    for (int kb = lo / KEY_BLOCK; kb * KEY_BLOCK < hi; ++kb) {
      const int j0 = kb * KEY_BLOCK, nk = std::min(KEY_BLOCK, j.S - j0);
      float* kt = sc.kt.data();
      for (int x = 0; x < nk; ++x) {
        const float* kr = K ? K + (size_t)(j0 + x) * D : sc.row.data();
        if (q8) dequant_q8_row(j.keys8 + (head + j0 + x) * rb, D, sc.row.data());
        for (int d = 0; d < D; ++d) kt[(size_t)d * KEY_BLOCK + x] = kr[d];
      }
      for (int x = nk; x < KEY_BLOCK; ++x)
        for (int d = 0; d < D; ++d) kt[(size_t)d * KEY_BLOCK + x] = 0.0f;
      for (int n0 = 0; n0 < NP; n0 += R)
        for (int c0 = 0; c0 < KEY_BLOCK; c0 += NC * W)
          scores(sc.qs.data() + (size_t)n0 * D, D, kt, c0, sc.s.data() + (size_t)n0 * KEY_BLOCK);
      bool any = false;
      for (int n = 0; n < NP; ++n) {
        float* s = sc.s.data() + (size_t)n * KEY_BLOCK;
        if (n >= N) {  // padding vectors: weights 0, kept as they are
          for (int x = 0; x < KEY_BLOCK; ++x) s[x] = 0.0f;
          sc.a[n] = 1.0f;
          continue;
        }
        const int i = a0 + n / rep;
        const size_t mr = (size_t)j.mrow(b) * j.L + i;
        const int f = std::max(j.first[mr] - j0, 0), e = std::min(j.last[mr] - j0, nk);
        if (f >= e) {  // nothing seen in this block: the query stays as it is
          for (int x = 0; x < KEY_BLOCK; ++x) s[x] = 0.0f;
          sc.a[n] = 1.0f;
          continue;
        }
        if (j.softcap != 0.0f)
          for (int x = f; x < e; ++x) s[x] = std::tanh(s[x] / j.softcap) * j.softcap;
        for (int x = 0; x < f; ++x) s[x] = ninf;
        for (int x = e; x < KEY_BLOCK; ++x) s[x] = ninf;
        if (j.mask && j.gaps[mr]) {
          const bool* mk = j.mask + mr * j.S + j0;
          for (int x = f; x < e; ++x)
            if (!mk[x]) s[x] = ninf;
        }
        const float top = block_max(s);
        const float mn = std::max(sc.m[n], top);
        if (mn == ninf) {  // nothing seen yet
          for (int x = 0; x < KEY_BLOCK; ++x) s[x] = 0.0f;
          sc.a[n] = 1.0f;
          continue;
        }
        any = true;
        float a = 1.0f;
        if (mn != sc.m[n]) {
          if (sc.m[n] == ninf) {
            a = 0.0f;
          } else {
            a = sc.m[n] - mn;
            exp_inplace(&a, 1);
          }
        }
        for (int x = 0; x < KEY_BLOCK; ++x) s[x] -= mn;
        exp_inplace(s, KEY_BLOCK);
        const float t = block_sum(s);
        sc.l[n] = sc.l[n] * a + t;
        sc.m[n] = mn;
        sc.a[n] = a;
      }
      if (!any) continue;  // every query of the tile stays as it is
      const float* vb = Vv ? Vv + (size_t)j0 * D : sc.vd.data();
      if (q8)
        for (int x = 0; x < nk; ++x) dequant_q8_row(j.values8 + (head + j0 + x) * rb, D, sc.vd.data() + (size_t)x * D);
      for (int n0 = 0; n0 < NP; n0 += R) {
        const float* p = sc.s.data() + (size_t)n0 * KEY_BLOCK;
        float* o = sc.o.data() + (size_t)n0 * D;
        // the features in chunks fixed by D alone: 32 at a time, then 16, then one by one
        int d0 = 0;
        for (; d0 + 32 <= D; d0 += 32) values<32 / W>(p, vb, nk, D, d0, sc.a.data() + n0, o);
        for (; d0 + 16 <= D; d0 += 16) values<16 / W>(p, vb, nk, D, d0, sc.a.data() + n0, o);
        for (; d0 < D; ++d0)
          for (int r = 0; r < R; ++r) {
            float acc = 0.0f;
            for (int x = 0; x < nk; ++x) acc += vb[(size_t)x * D + d0] * p[(size_t)r * KEY_BLOCK + x];
            o[(size_t)r * D + d0] = acc + o[(size_t)r * D + d0] * sc.a[n0 + r];
          }
      }
    }
    for (int n = 0; n < N; ++n) {
      const int i = a0 + n / rep, r = n % rep;
      float* out = j.out + (((size_t)b * j.H + g * rep + r) * j.L + i) * D;
      const float* o = sc.o.data() + (size_t)n * D;
      const float l = sc.l[n];
      for (int d = 0; d < D; ++d) out[d] = l > 0.0f ? o[d] / l : 0.0f;
    }
  }
};
