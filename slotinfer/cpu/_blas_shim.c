/* Unprefixed CBLAS entry points forwarding to an OpenBLAS build.
 *
 * MLX's Linux wheel binds cblas_sgemm/dgemm/cgemm to a reference BLAS.  The
 * fastest OpenBLAS builds on PyPI (scipy-openblas32, numpy's bundled copy)
 * export only prefixed names (scipy_cblas_sgemm, scipy_cblas_sgemm64_), so
 * loading them globally interposes nothing.  This file exports the names MLX
 * looks up and forwards to the real functions, which slotinfer/cpu/blas.py resolves
 * at runtime through slotinfer_shim_init(): no build-time paths are baked in.
 *
 * It also sends single-row / single-column sgemm (a decode step with one
 * sequence) to sgemv: OpenBLAS's gemm packs the whole weight matrix first and
 * runs ~2.5x slower there (measured, docs/blas.md).
 *
 * And it computes small products itself.  A decode step's attention is, per
 * slot and KV head, a [group x head_dim] @ [head_dim x span] product and its
 * [group x span] @ [span x head_dim] twin: MLX's CPU backend makes one CBLAS
 * call per (slot, head) -- hundreds per layer -- and each costs OpenBLAS
 * microseconds of argument checks, buffer allocation and packing for a few
 * thousand multiply-adds.  The loops below run in registers instead
 * (docs/blas.md has the measurement).  Each output element is summed in a
 * fixed order that depends only on its own row and column and on which of two
 * forms the call takes (fewer than 8 rows or not; _blas_kernels.h), never on the
 * other rows or on how many columns the call has, so a decode step's fixed batch
 * and a padded span cannot change it.
 *
 * Built as a plain shared object (no Python API); loaded through ctypes.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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
static int own_on = 1;
#define OWN_ROWS 64  /* products with 2 .. OWN_ROWS rows against a stored weight: slotinfer's loops */
#define OUTER_ROWS 8 /* from this many rows on, the outer form (below); fewer, the dot form */

/* Turn slotinfer's own loops (below) off (0) or on (1), leaving every product to the
 * library; returns the previous setting.  For checking the forwarded library alone,
 * and for measuring the difference. */
int slotinfer_shim_own(int on) {
  int was = own_on;
  own_on = on;
  return was;
}

/* -- loops ---------------------------------------------------------------- */

typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

#define load8(p) ({ v8f v_; __builtin_memcpy(&v_, (p), sizeof v_); v_; })
#define store8(p, v) ({ v8f w_ = (v); __builtin_memcpy((p), &w_, sizeof w_); })

#define KERNEL(name) name##_base
#define KATTR
#include "_blas_kernels.h"
#undef KERNEL
#undef KATTR

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2 1
#define KERNEL(name) name##_avx2
#define KATTR __attribute__((target("avx2,fma")))
#include "_blas_kernels.h"
#undef KERNEL
#undef KATTR
#endif

typedef void (*nt_cols_t)(int, int, int, int, float, const float *, long, const float *, long,
                          float, float *, long);
typedef void (*nn_small_t)(int, int, int, float, const float *, long, const float *, long, float,
                           float *, long);
typedef void (*tn_pack_t)(int, int, const float *, long, float *);
typedef void (*tn_cols_t)(int, int, int, int, float, const float *, const float *, long, float,
                          float *, long);
static nt_cols_t nt_cols = nt_cols_base;
static nn_small_t nn_small = nn_small_base;
static tn_pack_t tn_pack = tn_pack_base;
static tn_cols_t tn_cols = tn_cols_base;

static void pick_kernels(void) {
#ifdef HAVE_AVX2
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    nt_cols = nt_cols_avx2;
    nn_small = nn_small_avx2;
    tn_pack = tn_pack_avx2;
    tn_cols = tn_cols_avx2;
  }
#endif
}

/* Which kernels the loops run: 1 the AVX2+FMA ones where the CPU has them (the default
 * after init), 0 the portable ones (plain C vectors, any CPU).  Returns whether the AVX2
 * ones are now in use.  The tests hold both to the same properties; not for use while
 * another thread is inside a product. */
int slotinfer_shim_kernels(int fast) {
  nt_cols = nt_cols_base;
  nn_small = nn_small_base;
  tn_pack = tn_pack_base;
  tn_cols = tn_cols_base;
  if (fast) pick_kernels();
  return nt_cols != nt_cols_base;
}

/* -- threads -------------------------------------------------------------- */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

/* A tiny pool: the caller takes the first share of the columns, workers the rest.
 * Workers spin briefly between products (a decode step issues them back to back),
 * then sleep on a condition variable. */
#define MAX_THREADS 64
static int n_threads = 1, n_started = 0;
static pthread_t workers[MAX_THREADS];
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;  /* one product at a time */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static volatile long generation = 0;
static volatile int remaining = 0;
static struct {
  int m, n, k, parts;
  float alpha, beta;
  const float *a, *b, *ap;  /* ap: A packed for the outer form, else NULL */
  float *c;
  long lda, ldb, ldc;
} job;

static void run_part(int part) {
  /* column ranges in multiples of the tile width, so parts share no tile */
  int w = job.ap ? 6 : 3;
  int tiles = (job.n + w - 1) / w;
  int t0 = (int)((long)tiles * part / job.parts), t1 = (int)((long)tiles * (part + 1) / job.parts);
  int j0 = w * t0, j1 = w * t1 < job.n ? w * t1 : job.n;
  if (j0 >= j1) return;
  if (job.ap)
    tn_cols(job.m, j0, j1, job.k, job.alpha, job.ap, job.b, job.ldb, job.beta, job.c, job.ldc);
  else
    nt_cols(job.m, j0, j1, job.k, job.alpha, job.a, job.lda, job.b, job.ldb, job.beta, job.c, job.ldc);
}

static long start_generation[MAX_THREADS];

static void *worker(void *arg) {
  int part = (int)(long)arg;
  long seen = start_generation[part];  /* the product that started it comes after this */
  for (;;) {
    int spins = 0;
    while (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen && spins < 200) {
      CPU_RELAX();
      spins++;
    }
    if (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen) {
      pthread_mutex_lock(&wake_mu);
      while (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen) pthread_cond_wait(&wake_cv, &wake_mu);
      pthread_mutex_unlock(&wake_mu);
    }
    seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    if (part < job.parts) run_part(part);
    __atomic_sub_fetch(&remaining, 1, __ATOMIC_ACQ_REL);
  }
  return NULL;
}

static void after_fork_child(void) {  /* the workers did not come along; nor did any lock holder */
  n_started = 0;
  pthread_mutex_init(&pool_mu, NULL);
  pthread_mutex_init(&wake_mu, NULL);
  pthread_cond_init(&wake_cv, NULL);
}

/* Threads for slotinfer's own products (the library's own setting is separate). */
int slotinfer_shim_threads(int n) {
  if (n < 1) n = 1;
  if (n > MAX_THREADS) n = MAX_THREADS;
  n_threads = n;
  return n;
}

/* The calling thread's buffer for A packed by tn_pack (grown, never shrunk). */
static const float *packed(int m, int k, const float *a, int lda) {
  static __thread float *buf;
  static __thread size_t cap;
  size_t need = (size_t)(m + 15) / 16 * 16 * k;
  if (need > cap) {
    free(buf);
    buf = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
    cap = buf ? need : 0;
  }
  if (buf) tn_pack(m, k, a, lda, buf);
  return buf;
}

static void own_sgemm(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                      int ldb, float beta, float *c, int ldc) {
  const float *ap = m >= OUTER_ROWS ? packed(m, k, a, lda) : NULL;
  int parts = n_threads;
  if ((long)m * n * k < (1L << 20) || pthread_mutex_trylock(&pool_mu) != 0) parts = 1;
  if (parts == 1) {
    if (ap)
      tn_cols(m, 0, n, k, alpha, ap, b, ldb, beta, c, ldc);
    else
      nt_cols(m, 0, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  static int registered = 0;
  if (!registered) {
    pthread_atfork(NULL, NULL, after_fork_child);
    registered = 1;
  }
  while (n_started < parts - 1) {
    start_generation[n_started + 1] = generation;
    if (pthread_create(&workers[n_started], NULL, worker, (void *)(long)(n_started + 1)) != 0) break;
    pthread_detach(workers[n_started]);
    n_started++;
  }
  parts = n_started + 1 < parts ? n_started + 1 : parts;
  job.m = m; job.n = n; job.k = k; job.parts = parts;
  job.alpha = alpha; job.beta = beta;
  job.a = a; job.b = b; job.ap = ap; job.c = c;
  job.lda = lda; job.ldb = ldb; job.ldc = ldc;
  __atomic_store_n(&remaining, n_started, __ATOMIC_RELEASE);
  pthread_mutex_lock(&wake_mu);
  __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
  pthread_cond_broadcast(&wake_cv);
  pthread_mutex_unlock(&wake_mu);
  run_part(0);
  for (int spins = 0; __atomic_load_n(&remaining, __ATOMIC_ACQUIRE) > 0; spins++) {
    if (spins < 4000)
      CPU_RELAX();
    else
      sched_yield();  /* a worker still to run may need this core */
  }
  pthread_mutex_unlock(&pool_mu);
}

/* -- routing -------------------------------------------------------------- */

/* Products of at most SMALL_MNK multiply-adds go through the loops, the rest to the
 * library.  2^18 covers a decode step's attention up to a span of 1024 (group 2,
 * head_dim 128); past that the library's per-call cost is small next to the work. */
#define SMALL_MNK (1L << 18)

/* Row-major, A not transposed; returns 1 when it computed the product. */
static int own_product(int trb, int m, int n, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc) {
  long mnk = (long)m * n * k;
  if (!own_on) return 0;
  if (trb && (mnk <= SMALL_MNK || (m >= 2 && m <= OWN_ROWS))) {
    own_sgemm(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return 1;
  }
  if (mnk <= SMALL_MNK) {
    nn_small(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return 1;
  }
  return 0;
}

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
  pick_kernels();
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
  if (!tra && m > 0 && n > 0 && k > 0 && own_product(trb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
    return;
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
