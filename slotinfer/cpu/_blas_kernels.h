/* slotinfer's own sgemm loops, included by _blas_shim.c once per instruction
 * set: KERNEL(name) gives each copy its own names, KATTR its target attribute.
 *
 * Two forms, each with one arithmetic per output element whichever tile, thread,
 * row count or column count produced it, so a row's result never depends on the
 * other rows of the call (the batch) or on how many columns it has (a padded span):
 *
 * - dot form (nt_*): c[i,j] is one 8-lane partial sum over k in ascending order,
 *   reduced in a fixed order, then a scalar tail.  Reads 3 weight rows 8 floats at a
 *   time: the fastest way to stream weights when there are few rows to reuse them.
 * - outer form (tn_*): c[i,j] is one multiply-add chain over k in ascending order, in
 *   the lane of row i.  Rows of A are packed 8 to a panel; each weight is broadcast
 *   against two panels (16 rows), so 6 broadcasts and 2 loads feed 12 multiply-adds.
 *   ~1.35x the dot form's throughput from 16 rows up, less than it below 8.
 */

/* Sum of the 8 lanes, in a fixed order. */
KATTR static inline __attribute__((always_inline)) float KERNEL(hsum)(v8f s) {
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

/* alpha * s + beta * c, with c not read when beta is 0 (BLAS: it may hold NaN). */
KATTR static inline __attribute__((always_inline)) float KERNEL(axpby)(float alpha, float s, float beta,
                                                                      const float *c) {
  return alpha * s + (beta == 0.0f ? 0.0f : beta * *c);
}

/* c[i,j] from its 8-lane accumulator: lanes summed in a fixed order, then the
 * scalar tail k0 .. k (when k is not a multiple of 8). */
KATTR static inline __attribute__((always_inline)) void KERNEL(finish)(
    v8f acc, const float *ai, const float *bj, int k0, int k, float alpha, float beta, float *cij) {
  float s = KERNEL(hsum)(acc);
  for (int q = k0; q < k; q++) s += ai[q] * bj[q];
  *cij = KERNEL(axpby)(alpha, s, beta, cij);
}

/* One element (edge tiles): the same arithmetic as the 4 x 3 tile below. */
KATTR static void KERNEL(nt_1x1)(int k, float alpha, const float *a, const float *b, float beta,
                                 float *c) {
  v8f acc = {0};
  int p = 0;
  for (; p + 8 <= k; p += 8) acc += load8(a + p) * load8(b + p);
  KERNEL(finish)(acc, a, b, p, k, alpha, beta, c);
}

/* Rows i .. i+4 of A against rows j .. j+3 of B (B given [n, k]): 12 accumulators in
 * registers, 7 loads per 12 multiply-adds. */
KATTR static void KERNEL(nt_4x3)(int k, float alpha, const float *a, long lda, const float *b,
                                 long ldb, float beta, float *c, long ldc) {
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
  const float *b0 = b, *b1 = b + ldb, *b2 = b + 2 * ldb;
  v8f c00 = {0}, c01 = {0}, c02 = {0}, c10 = {0}, c11 = {0}, c12 = {0};
  v8f c20 = {0}, c21 = {0}, c22 = {0}, c30 = {0}, c31 = {0}, c32 = {0};
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    v8f w0 = load8(b0 + p), w1 = load8(b1 + p), w2 = load8(b2 + p), x;
    x = load8(a0 + p); c00 += x * w0; c01 += x * w1; c02 += x * w2;
    x = load8(a1 + p); c10 += x * w0; c11 += x * w1; c12 += x * w2;
    x = load8(a2 + p); c20 += x * w0; c21 += x * w1; c22 += x * w2;
    x = load8(a3 + p); c30 += x * w0; c31 += x * w1; c32 += x * w2;
  }
  KERNEL(finish)(c00, a0, b0, p, k, alpha, beta, c);
  KERNEL(finish)(c01, a0, b1, p, k, alpha, beta, c + 1);
  KERNEL(finish)(c02, a0, b2, p, k, alpha, beta, c + 2);
  KERNEL(finish)(c10, a1, b0, p, k, alpha, beta, c + ldc);
  KERNEL(finish)(c11, a1, b1, p, k, alpha, beta, c + ldc + 1);
  KERNEL(finish)(c12, a1, b2, p, k, alpha, beta, c + ldc + 2);
  KERNEL(finish)(c20, a2, b0, p, k, alpha, beta, c + 2 * ldc);
  KERNEL(finish)(c21, a2, b1, p, k, alpha, beta, c + 2 * ldc + 1);
  KERNEL(finish)(c22, a2, b2, p, k, alpha, beta, c + 2 * ldc + 2);
  KERNEL(finish)(c30, a3, b0, p, k, alpha, beta, c + 3 * ldc);
  KERNEL(finish)(c31, a3, b1, p, k, alpha, beta, c + 3 * ldc + 1);
  KERNEL(finish)(c32, a3, b2, p, k, alpha, beta, c + 3 * ldc + 2);
}

/* One row of A against rows j .. j+3 of B: a single sequence's decode. */
KATTR static void KERNEL(nt_1x3)(int k, float alpha, const float *a, const float *b, long ldb,
                                 float beta, float *c) {
  const float *b0 = b, *b1 = b + ldb, *b2 = b + 2 * ldb;
  v8f c0 = {0}, c1 = {0}, c2 = {0};
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    v8f x = load8(a + p);
    c0 += x * load8(b0 + p); c1 += x * load8(b1 + p); c2 += x * load8(b2 + p);
  }
  KERNEL(finish)(c0, a, b0, p, k, alpha, beta, c);
  KERNEL(finish)(c1, a, b1, p, k, alpha, beta, c + 1);
  KERNEL(finish)(c2, a, b2, p, k, alpha, beta, c + 2);
}

/* c[0:m, j0:j1] = alpha * A B^T + beta * C, B given [n, k] (a weight matrix as stored). */
KATTR static void KERNEL(nt_cols)(int m, int j0, int j1, int k, float alpha, const float *a,
                                  long lda, const float *b, long ldb, float beta, float *c,
                                  long ldc) {
  /* Chunks of B rows sized to stay in L2 (~192 KiB) while every 4-row block of A,
   * kept in L1, passes over them: B comes from memory once, A from L1. */
  int chunk = (int)((192L << 10) / ((long)k * 4)) / 3 * 3;
  if (chunk < 3) chunk = 3;
  int j = j0;
  for (; j + 3 <= j1; j += chunk) {
    int je = j + chunk < j1 ? j + chunk : j1;
    je = j + (je - j) / 3 * 3;
    int i = 0;
    for (; i + 4 <= m; i += 4)
      for (int jj = j; jj < je; jj += 3)
        KERNEL(nt_4x3)(k, alpha, a + i * lda, lda, b + jj * ldb, ldb, beta, c + i * ldc + jj, ldc);
    for (; i < m; i++)
      for (int jj = j; jj < je; jj += 3)
        KERNEL(nt_1x3)(k, alpha, a + i * lda, b + jj * ldb, ldb, beta, c + i * ldc + jj);
    if (je < j + chunk) { j = je; break; }
  }
  for (; j < j1; j++)
    for (int i = 0; i < m; i++) KERNEL(nt_1x1)(k, alpha, a + i * lda, b + j * ldb, beta, c + i * ldc + j);
}

/* c[i,j] = alpha * sum_p a[i,p] * b[p,j] + beta * c[i,j]  (B given [k, n]: rows of B scaled and added,
 * ascending p, so trailing zero weights add exact zeros) */
KATTR static void KERNEL(nn_small)(int m, int n, int k, float alpha, const float *a, long lda,
                                   const float *b, long ldb, float beta, float *c, long ldc) {
  enum { W = 256 };
  float acc[W] __attribute__((aligned(32)));
  for (int i = 0; i < m; i++) {
    const float *ai = a + i * lda;
    for (int j0 = 0; j0 < n; j0 += W) {
      int w = n - j0 < W ? n - j0 : W;
      for (int j = 0; j < w; j++) acc[j] = 0.0f;
      for (int p = 0; p < k; p++) {
        float x = ai[p];
        const float *bp = b + p * ldb + j0;
        int j = 0;
        for (; j + 8 <= w; j += 8) store8(acc + j, load8(acc + j) + x * load8(bp + j));
        for (; j < w; j++) acc[j] += x * bp[j];
      }
      float *ci = c + i * ldc + j0;
      for (int j = 0; j < w; j++) ci[j] = KERNEL(axpby)(alpha, acc[j], beta, ci + j);
    }
  }
}

/* -- outer form ----------------------------------------------------------- */

/* Rows of A packed in panels of 8: ap[q][p][r] = a[8q + r, p]; rows past m are zero.
 * Always an even number of panels (tiles take two).  Full panels go 8 x 8 blocks at a
 * time through registers (an in-register transpose); the rest element by element. */
#define SHUF(x, y, ...) __builtin_shuffle(x, y, (v8i){__VA_ARGS__})
KATTR static void KERNEL(tn_pack)(int m, int k, const float *a, long lda, float *ap) {
  int panels = (m + 15) / 16 * 2;
  for (int q = 0; q < panels; q++) {
    float *dst = ap + (long)q * 8 * k;
    const float *src = a + (long)8 * q * lda;
    int rows = m - 8 * q;
    rows = rows < 0 ? 0 : rows > 8 ? 8 : rows;
    int p = 0;
    if (rows == 8)
      for (; p + 8 <= k; p += 8) {
        v8f r0 = load8(src + p), r1 = load8(src + lda + p), r2 = load8(src + 2 * lda + p);
        v8f r3 = load8(src + 3 * lda + p), r4 = load8(src + 4 * lda + p), r5 = load8(src + 5 * lda + p);
        v8f r6 = load8(src + 6 * lda + p), r7 = load8(src + 7 * lda + p);
        v8f t0 = SHUF(r0, r1, 0, 8, 1, 9, 4, 12, 5, 13), t1 = SHUF(r0, r1, 2, 10, 3, 11, 6, 14, 7, 15);
        v8f t2 = SHUF(r2, r3, 0, 8, 1, 9, 4, 12, 5, 13), t3 = SHUF(r2, r3, 2, 10, 3, 11, 6, 14, 7, 15);
        v8f t4 = SHUF(r4, r5, 0, 8, 1, 9, 4, 12, 5, 13), t5 = SHUF(r4, r5, 2, 10, 3, 11, 6, 14, 7, 15);
        v8f t6 = SHUF(r6, r7, 0, 8, 1, 9, 4, 12, 5, 13), t7 = SHUF(r6, r7, 2, 10, 3, 11, 6, 14, 7, 15);
        v8f u0 = SHUF(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13), u1 = SHUF(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
        v8f u2 = SHUF(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13), u3 = SHUF(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
        v8f u4 = SHUF(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13), u5 = SHUF(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
        v8f u6 = SHUF(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13), u7 = SHUF(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
        float *d = dst + 8L * p;
        store8(d, SHUF(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11));
        store8(d + 8, SHUF(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11));
        store8(d + 16, SHUF(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11));
        store8(d + 24, SHUF(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11));
        store8(d + 32, SHUF(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15));
        store8(d + 40, SHUF(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15));
        store8(d + 48, SHUF(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15));
        store8(d + 56, SHUF(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15));
      }
    for (; p < k; p++)
      for (int r = 0; r < 8; r++) dst[p * 8 + r] = r < rows ? src[(long)r * lda + p] : 0.0f;
  }
}
#undef SHUF

/* 6 weight rows (j .. j+6) against a panel pair: out[2r + h] holds c[8h .. 8h+8, j+r].
 * (alpha and beta are applied by the caller: kept out of here, all 16 vector registers
 * hold the tile and the loop never touches the stack.) */
KATTR static void KERNEL(tn_6x16)(int k, const float *ap, const float *w, long ldw, v8f *out) {
  const float *ap0 = ap, *ap1 = ap + 8L * k;
  const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw, *w4 = w + 4 * ldw, *w5 = w + 5 * ldw;
  v8f a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
  v8f a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
  for (int p = 0; p < k; p++) {
    v8f x0 = load8(ap0 + 8 * p), x1 = load8(ap1 + 8 * p), b;
    float s;
#define TN_ROW(r) s = w##r[p]; b = (v8f){s, s, s, s, s, s, s, s}; a##r##0 += b * x0; a##r##1 += b * x1;
    TN_ROW(0) TN_ROW(1) TN_ROW(2) TN_ROW(3) TN_ROW(4) TN_ROW(5)
#undef TN_ROW
  }
  out[0] = a00; out[1] = a01; out[2] = a10; out[3] = a11; out[4] = a20; out[5] = a21;
  out[6] = a30; out[7] = a31; out[8] = a40; out[9] = a41; out[10] = a50; out[11] = a51;
}

/* One weight row against a panel pair (the last columns): the same chain per element. */
KATTR static void KERNEL(tn_1x16)(int k, const float *ap, const float *w, v8f *out) {
  const float *ap0 = ap, *ap1 = ap + 8L * k;
  v8f a0 = {0}, a1 = {0};
  for (int p = 0; p < k; p++) {
    float s = w[p];
    v8f b = {s, s, s, s, s, s, s, s};
    a0 += b * load8(ap0 + 8 * p);
    a1 += b * load8(ap1 + 8 * p);
  }
  out[0] = a0; out[1] = a1;
}

/* c[0:rows, 0:cols] = alpha * tile + beta * c, from out[2r + h] (lane i & 7 of row i). */
KATTR static void KERNEL(tn_store)(int rows, int cols, float alpha, float beta, const v8f *out,
                                   float *c, long ldc) {
  for (int i = 0; i < rows; i++)
    for (int r = 0; r < cols; r++) {
      float *cij = c + i * ldc + r;
      *cij = KERNEL(axpby)(alpha, out[2 * r + (i >> 3)][i & 7], beta, cij);
    }
}

/* c[0:m, j0:j1] = alpha * A B^T + beta * C from A packed by tn_pack, B given [n, k]. */
KATTR static void KERNEL(tn_cols)(int m, int j0, int j1, int k, float alpha, const float *ap,
                                  const float *b, long ldb, float beta, float *c, long ldc) {
  /* Chunks of B rows sized to stay in L2 (~256 KiB) while every panel pair passes over them. */
  int chunk = (int)((256L << 10) / ((long)k * 4)) / 6 * 6;
  if (chunk < 6) chunk = 6;
  v8f out[12];
  for (int jc = j0; jc < j1; jc += chunk) {
    int je = jc + chunk < j1 ? jc + chunk : j1;
    for (int i = 0; i < m; i += 16) {
      int rows = m - i < 16 ? m - i : 16;
      const float *api = ap + (long)i * k;
      int j = jc;
      for (; j + 6 <= je; j += 6) {
        KERNEL(tn_6x16)(k, api, b + j * ldb, ldb, out);
        KERNEL(tn_store)(rows, 6, alpha, beta, out, c + i * ldc + j, ldc);
      }
      for (; j < je; j++) {
        KERNEL(tn_1x16)(k, api, b + j * ldb, out);
        KERNEL(tn_store)(rows, 1, alpha, beta, out, c + i * ldc + j, ldc);
      }
    }
  }
}
