/* Unprefixed CBLAS entry points forwarding to an OpenBLAS build.
 *
 * MLX's Linux wheel binds cblas_sgemm/dgemm/cgemm to a reference BLAS.  The
 * fastest OpenBLAS builds on PyPI (scipy-openblas32, numpy's bundled copy)
 * export only prefixed names (scipy_cblas_sgemm, scipy_cblas_sgemm64_), so
 * loading them globally interposes nothing.  This file exports the names MLX
 * looks up and forwards to the real functions, which slotinfer._blas resolves
 * at runtime through slotinfer_shim_init(): no build-time paths are baked in.
 *
 * It also sends single-row / single-column sgemm (a decode step with one
 * sequence) to sgemv: OpenBLAS's gemm packs the whole weight matrix first and
 * runs ~2.5x slower there (measured, docs/blas.md).
 *
 * Built as a plain shared object (no Python API); loaded through ctypes.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

typedef void (*sgemm32_t)(int, int, int, int, int, int, float, const float *,
                          int, const float *, int, float, float *, int);
typedef void (*dgemm32_t)(int, int, int, int, int, int, double, const double *,
                          int, const double *, int, double, double *, int);
typedef void (*cgemm32_t)(int, int, int, int, int, int, const void *,
                          const void *, int, const void *, int, const void *,
                          void *, int);
typedef void (*sgemv32_t)(int, int, int, int, float, const float *, int,
                          const float *, int, float, float *, int);
/* ILP64 builds (numpy's bundled OpenBLAS) take 64-bit sizes; enums stay int. */
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float,
                          const float *, int64_t, const float *, int64_t, float,
                          float *, int64_t);
typedef void (*sgemv64_t)(int, int, int64_t, int64_t, float, const float *,
                          int64_t, const float *, int64_t, float, float *,
                          int64_t);
typedef void (*dgemm64_t)(int, int, int, int64_t, int64_t, int64_t, double,
                          const double *, int64_t, const double *, int64_t,
                          double, double *, int64_t);
typedef void (*cgemm64_t)(int, int, int, int64_t, int64_t, int64_t,
                          const void *, const void *, int64_t, const void *,
                          int64_t, const void *, void *, int64_t);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

static void *s_fn, *d_fn, *c_fn, *sv_fn;
static int ilp64;

static void *resolve(void *h, const char *prefix, const char *name,
                     const char *suffix) {
  char sym[128];
  snprintf(sym, sizeof sym, "%s%s%s", prefix, name, suffix);
  return dlsym(h, sym);
}

/* Returns 0 on success.  Called (through ctypes) before this object is
 * promoted to the global symbol scope, so MLX never sees null pointers. */
int slotinfer_shim_init(const char *path, const char *prefix,
                        const char *suffix, int is_ilp64) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) return 1;
  s_fn = resolve(h, prefix, "cblas_sgemm", suffix);
  d_fn = resolve(h, prefix, "cblas_dgemm", suffix);
  c_fn = resolve(h, prefix, "cblas_cgemm", suffix);
  sv_fn = resolve(h, prefix, "cblas_sgemv", suffix);
  ilp64 = is_ilp64;
  return (s_fn && d_fn && c_fn && sv_fn) ? 0 : 2;
}

static void sgemv(int trans, int m, int n, float alpha, const float *a,
                  int lda, const float *x, int incx, float beta, float *y,
                  int incy) {
  if (beta == 0.0f)  /* BLAS: y need not be set when beta is 0; it may hold NaN */
    for (int i = 0; i < (trans == NO_TRANS ? m : n); i++) y[(long)i * incy] = 0.0f;
  if (ilp64)
    ((sgemv64_t)sv_fn)(ROW_MAJOR, trans, m, n, alpha, a, lda, x, incx, beta, y, incy);
  else
    ((sgemv32_t)sv_fn)(ROW_MAJOR, trans, m, n, alpha, a, lda, x, incx, beta, y, incy);
}

void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta,
                 float *c, int ldc) {
  if (o != ROW_MAJOR) {  /* column-major C = A B is row-major C^T = B^T A^T */
    const float *t = a; a = b; b = t;
    int i = ta; ta = tb; tb = i;
    i = m; m = n; n = i;
    i = lda; lda = ldb; ldb = i;
  }
  int tra = ta != NO_TRANS, trb = tb != NO_TRANS;
  if (m == 1 && n > 1 && k > 1) {  /* c[0,:] = a[0,:] @ op(B) */
    if (trb)
      sgemv(NO_TRANS, n, k, alpha, b, ldb, a, tra ? lda : 1, beta, c, 1);
    else
      sgemv(TRANS, k, n, alpha, b, ldb, a, tra ? lda : 1, beta, c, 1);
    return;
  }
  if (n == 1 && m > 1 && k > 1) {  /* c[:,0] = op(A) @ b[:,0] */
    if (tra)
      sgemv(TRANS, k, m, alpha, a, lda, b, trb ? 1 : ldb, beta, c, ldc);
    else
      sgemv(NO_TRANS, m, k, alpha, a, lda, b, trb ? 1 : ldb, beta, c, ldc);
    return;
  }
  if (ilp64)
    ((sgemm64_t)s_fn)(ROW_MAJOR, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    ((sgemm32_t)s_fn)(ROW_MAJOR, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, double alpha,
                 const double *a, int lda, const double *b, int ldb,
                 double beta, double *c, int ldc) {
  if (ilp64)
    ((dgemm64_t)d_fn)(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    ((dgemm32_t)d_fn)(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int o, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb,
                 const void *beta, void *c, int ldc) {
  if (ilp64)
    ((cgemm64_t)c_fn)(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    ((cgemm32_t)c_fn)(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
