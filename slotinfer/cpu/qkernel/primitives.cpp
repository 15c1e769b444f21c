// MLX primitives, CPU only: x @ dequant(W).T with W in GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), a decode
// step's RMSNorm, rope from tables and paged attention (one node each), and the fused blocks that
// compose them; with the functions that check their inputs and build their nodes.  The loops are
// in kernels.h, the threads in pool.h.
#include "primitives.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "mlx/ops.h"
#include "pool.h"
#include "rowwise.h"

namespace qk {

Format parse_format(const std::string& name) {
  if (name == "q8_0") return Format::Q8_0;
  if (name == "q4_0") return Format::Q4_0;
  if (name == "q4_1") return Format::Q4_1;
  if (name == "q5_0") return Format::Q5_0;
  if (name == "q4_k") return Format::Q4_K;
  if (name == "q6_k") return Format::Q6_K;
  throw std::invalid_argument("format must be q8_0, q4_0, q4_1, q5_0, q4_k or q6_k, got " + name);
}

namespace {

// The columns go to the threads in pieces of whole groups of 8 (a thread never splits a sum).
constexpr int PIECES = 4, PIECE_GROUPS = 32;

// `spare`: the product is a node of its own in a graph of many (a decode step's separate nodes, its
// head), whose queueing keeps another thread busy (see below); false inside the fused blocks and
// in a step the host waits for (a speculative verify step: qlayers.all_cores).
void run(Format f, const float* x, const uint8_t* W, float* out, int m, int k, int n, bool spare = false) {
  int groups = (n + GROUP - 1) / GROUP;
  int threads = std::max(1, std::min(g_threads, groups));
  // below ~64k multiply-adds a thread's wake-up costs more than its share saves
  if ((long)m * n * k < 65536L * threads) threads = 1;
  // A product of at most g_spare_rows rows can leave one core to the thread that builds the next
  // step's graph meanwhile (set_spare_rows).  Off by default: measured on 2 cores, quiet, SmolLM2
  // Q4_1, every core in the head decodes 1.03-1.08x faster at one sequence and 1.02-1.18x at four
  // than the head on one thread (benchmarks/bench_spare_rows.py).
  if (spare && m <= g_spare_rows) threads = std::min(threads, std::max(1, g_threads - 1));
  // Up to PIECES a thread, of PIECE_GROUPS groups or more (a piece's first groups go without the
  // prefetch of the groups before them), taken by whichever thread is free: one that starts late
  // (woken from its sleep, its core taken by the engine's thread or another process) leaves its
  // share to the others.
  const int pieces = threads == 1 ? 1 : std::max(threads, std::min(threads * PIECES, groups / PIECE_GROUPS));
  Pieces next(pieces);
  std::function<void(int)> share = [&](int) {
    thread_local std::vector<float> buf;
    for (int p; (p = next.next()) >= 0;) {
      int j0 = std::min(n, (int)((long)groups * p / pieces) * GROUP);
      int j1 = std::min(n, (int)((long)groups * (p + 1) / pieces) * GROUP);
      if (j0 < j1) columns(Job{f, x, W, out, m, k, n, j0, j1}, buf);
    }
  };
  g_pool->run(threads, share);
}

// fn(r0, r1) over rows [0, rows) of row-local work (norms, activations, rope, residual adds: a row's
// values depend on that row alone, so any split gives the same bits), in pieces over the pool's
// threads where there is enough of it: `per_row` floats a row, below ~16k floats in all one thread
// (a worker's hand-over costs about what its share of that saves).  At 32 rows these loops took a
// tenth of a decode step on the stream's thread while the pool's other threads waited.
template <class F>
void pooled_rows(int64_t rows, int64_t per_row, F&& fn) {
  const int threads = (int)std::min<int64_t>(std::max(1, g_threads), rows);
  if (threads <= 1 || rows * per_row < 16384) return fn(int64_t{0}, rows);
  const int pieces = (int)std::min<int64_t>(rows, 2L * threads);
  Pieces next(pieces);
  std::function<void(int)> share = [&](int) {
    for (int p; (p = next.next()) >= 0;) fn(rows * p / pieces, rows * (p + 1) / pieces);
  };
  g_pool->run(threads, share);
}

// spare: whether the product may leave a core free at a few rows (see run); false where nothing
// would run on that core meanwhile (a step the host waits for).
class QuantizedLinear : public Rowwise {
 public:
  QuantizedLinear(mx::Stream s, Format f, bool spare) : Rowwise(s), format_(f), spare_(spare) {}
  const char* name() const override { return "QuantizedLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QuantizedLinear*>(&other);
    return o && o->format_ == format_ && o->spare_ == spare_;
  }

 protected:
  mx::Shape out_shape(const std::vector<mx::array>& in) const override {
    mx::Shape shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return shape;
  }
  Fn body(const std::vector<mx::array>& in) const override {
    const int k = in[0].shape(-1), n = in[1].shape(0), m = (int)(in[0].size() / std::max(k, 1));
    const Format f = format_;
    const bool spare = spare_;
    return [=](const std::vector<const float*>& x, const std::vector<const void*>& w, float* out) {
      run(f, x[0], static_cast<const uint8_t*>(w[0]), out, m, k, n, spare);
    };
  }

 private:
  Format format_;
  bool spare_;
};

class RmsNorm : public Rowwise {
 public:
  RmsNorm(mx::Stream s, float eps) : Rowwise(s), eps_(eps) {}
  const char* name() const override { return "SlotinferRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const RmsNorm*>(&other);
    return o && o->eps_ == eps_;
  }

 protected:
  mx::Shape out_shape(const std::vector<mx::array>& in) const override { return in[0].shape(); }
  Fn body(const std::vector<mx::array>& in) const override {
    int n = in[0].shape(-1);
    int64_t rows = in[0].size() / std::max(n, 1);
    bool weighted = in.size() > 1;
    float eps = eps_;
    return [=](const std::vector<const float*>& f, const std::vector<const void*>&, float* out) {
      pooled_rows(rows, n, [&](int64_t r0, int64_t r1) {
        rms_norm_rows(f[0] + r0 * n, weighted ? f[1] : nullptr, out + r0 * n, r1 - r0, n, eps);
      });
    };
  }

 private:
  float eps_;
};

class RopeApply : public Rowwise {
 public:
  explicit RopeApply(mx::Stream s) : Rowwise(s) {}
  const char* name() const override { return "SlotinferRope"; }
  bool is_equivalent(const mx::Primitive& other) const override { return dynamic_cast<const RopeApply*>(&other); }

 protected:
  mx::Shape out_shape(const std::vector<mx::array>& in) const override { return in[0].shape(); }
  Fn body(const std::vector<mx::array>& in) const override {
    int B = in[0].shape(0), H = in[0].shape(1), D = in[0].shape(3), half = in[1].shape(-1);
    bool per_row = in[1].shape(0) != 1 || B == 1;
    return [=](const std::vector<const float*>& f, const std::vector<const void*>&, float* out) {
      const int64_t row = (int64_t)H * D;
      pooled_rows(B, row, [&](int64_t b0, int64_t b1) {
        const int64_t t = per_row ? b0 * half : 0;
        rope_rows(f[0] + b0 * row, f[1] + t, f[2] + t, out + b0 * row, (int)(b1 - b0), H, D, half, per_row);
      });
    };
  }
};

// An attention job's sizes, for B rows of `heads` query heads over `keys` [blocks, kvh, bs, D]
// through `tables` [B, nblk], under `mask` (bool, one row of the span for all rows or one each).
// keys: a float32 pool, or a q8_0 one (uint8 rows of D / 32 * 34 bytes); D: the head size
AttendJob attend_job(int B, int heads, int D, const mx::array& keys, const mx::array& tables, const mx::array* mask,
                     float scale, float softcap) {
  AttendJob j{};
  j.B = B;
  j.H = heads;
  j.kvh = keys.shape(1);
  j.bs = keys.shape(2);
  j.D = D;
  j.nblk = tables.shape(1);
  j.scale = scale;
  j.softcap = softcap;
  j.mask_per_row = mask && mask->size() != (size_t)j.nblk * j.bs;
  return j;
}

// Attention of the job's rows on the pool's threads: its units (a row's K/V head, or a part of its
// query heads where there are too few rows and K/V heads to go round) each to the first free
// thread.  A head's values do not depend on the heads beside it, nor on the thread: the same result
// for any split, row count or thread count.
void attend_pooled(const AttendJob& j) {
  const int rep = j.H / j.kvh;
  int threads = std::max(1, g_threads);
  // below ~16k multiply-adds of scores a thread's share saves less than handing it over costs
  if ((long)j.B * j.H * j.nblk * j.bs * j.D < 16384L) threads = 1;
  // a part of a K/V head's query heads still dequantizes all of the head's q8_0 rows, which costs
  // more than the part's scores and sums: q8_0 pools are never split
  int split = 1;
  while (threads > 1 && !j.keys8 && (long)j.B * j.kvh * split < 4L * threads && split < rep) {
    do ++split;
    while (rep % split != 0);
  }
  const int units = j.B * j.kvh * split;
  if (threads == 1 || units == 1) return attend_rows(j, 0, j.B);
  Pieces next(units);
  std::function<void(int)> share = [&](int) {
    for (int u; (u = next.next()) >= 0;) attend_units(j, split, u, u + 1);
  };
  g_pool->run(std::min(threads, units), share);
}

class PagedDecodeAttention : public Rowwise {
 public:
  PagedDecodeAttention(mx::Stream s, float scale, float softcap) : Rowwise(s), scale_(scale), softcap_(softcap) {}
  const char* name() const override { return "SlotinferPagedDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PagedDecodeAttention*>(&other);
    return o && o->scale_ == scale_ && o->softcap_ == softcap_;
  }

 protected:
  // inputs: q [B, H, 1, D], keys, values [num_blocks, kvh, bs, D] float32 (or q8_0 rows, uint8),
  // tables [B, nblk] int32, and optionally a bool mask [B or 1, ..., span]
  mx::Shape out_shape(const std::vector<mx::array>& in) const override { return in[0].shape(); }
  Fn body(const std::vector<mx::array>& in) const override {
    bool masked = in.size() > 4, q8 = in[1].dtype() == mx::uint8;
    AttendJob j = attend_job(in[0].shape(0), in[0].shape(1), in[0].shape(3), in[1], in[3], masked ? &in[4] : nullptr,
                             scale_, softcap_);
    return [=](const std::vector<const float*>& f, const std::vector<const void*>& o, float* out) mutable {
      // floats: q, [keys, values]; others: [keys, values], tables, mask
      const int t = q8 ? 2 : 0;
      j.q = f[0];
      j.keys = q8 ? nullptr : f[1];
      j.values = q8 ? nullptr : f[2];
      j.keys8 = q8 ? static_cast<const uint8_t*>(o[0]) : nullptr;
      j.values8 = q8 ? static_cast<const uint8_t*>(o[1]) : nullptr;
      j.tables = static_cast<const int32_t*>(o[t]);
      j.mask = masked ? static_cast<const bool*>(o[t + 1]) : nullptr;
      j.out = out;
      attend_pooled(j);
    };
  }

 private:
  float scale_, softcap_;
};

// Sub-blocks of a decode step's pre-norm layer whose linear layers are in GGUF blocks, each one node
// composing the loops the separate nodes run, in the same order (the same values, bit for bit).
// The attention half, for one new token per row, is two nodes around the K/V writes (which stay
// MLX scatters, so the pools are written in place):
//   qkv_rope:   rope(qk_norm(qkv(rms_norm(x) * w_norm) + bias)) -> [B, 1, (heads + 2 kv_heads) D]
//   attend_out: x + o(attention of its queries over the pools' blocks)

// inputs: x [B, 1, hid], w_norm [hid], w_qkv (blocks), cos, sin [B or 1, half], then the optional
// bias [(heads + 2 kvh) D] and q/k norm weights [(heads + kvh) D]
class QkvRope : public Rowwise {
 public:
  QkvRope(mx::Stream s, Format f, float eps, int heads, int kv_heads, bool bias, bool qk_norm)
      : Rowwise(s), f_(f), eps_(eps), heads_(heads), kvh_(kv_heads), bias_(bias), qk_norm_(qk_norm) {}
  const char* name() const override { return "SlotinferQkvRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QkvRope*>(&other);
    return o && o->f_ == f_ && o->eps_ == eps_ && o->heads_ == heads_ && o->kvh_ == kvh_ && o->bias_ == bias_ &&
           o->qk_norm_ == qk_norm_;
  }

 protected:
  mx::Shape out_shape(const std::vector<mx::array>& in) const override {
    return {in[0].shape(0), 1, in[2].shape(0)};
  }
  Fn body(const std::vector<mx::array>& in) const override {
    const int B = in[0].shape(0), hid = in[0].shape(-1), nq = in[2].shape(0), H = heads_, kvh = kvh_;
    const int D = nq / (H + 2 * kvh), half = in[3].shape(-1);
    const bool per_row = in[3].size() != (size_t)half, bias = bias_, norm = qk_norm_;
    const Format f = f_;
    const float eps = eps_;
    return [=](const std::vector<const float*>& fp, const std::vector<const void*>& w, float* out) {
      // floats: x, w_norm, cos, sin, [bias], [qk_norm]
      const float* bp = bias ? fp[4] : nullptr;
      const float* qkw = norm ? fp[4 + bias] : nullptr;
      thread_local std::vector<float> xn;
      xn.resize((size_t)B * hid);
      float* xnp = xn.data();
      pooled_rows(B, hid, [&](int64_t b0, int64_t b1) {
        rms_norm_rows(fp[0] + b0 * hid, fp[1], xnp + b0 * hid, b1 - b0, hid, eps);
      });
      run(f, xnp, static_cast<const uint8_t*>(w[0]), out, B, hid, nq);
      pooled_rows(B, nq, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          float* row = out + (size_t)b * nq;
          if (bp)  // the projection's bias, added to its sums
            for (int i = 0; i < nq; ++i) row[i] = row[i] + bp[i];
          if (qkw)  // Qwen 3's and Gemma 3's per-head norms of queries and keys: (x * scale) * w
            for (int hh = 0; hh < H + kvh; ++hh)
              rms_norm_rows(row + (size_t)hh * D, qkw + (size_t)hh * D, row + (size_t)hh * D, 1, D, eps);
          size_t t = per_row ? (size_t)b * half : 0;
          rope_rows(row, fp[2] + t, fp[3] + t, row, 1, H + kvh, D, half, false);
        }
      });
    };
  }

 private:
  Format f_;
  float eps_;
  int heads_, kvh_;
  bool bias_, qk_norm_;
};

// inputs: qkv [B, 1, (heads + 2 kvh) D] (its queries are read), keys, values [blocks, kvh, bs, D],
// x [B, 1, hid] (the residual), tables [B, nblk] int32, mask bool [B or 1, span], w_o (blocks)
class AttendOut : public Rowwise {
 public:
  AttendOut(mx::Stream s, Format f, int heads, float scale, float softcap)
      : Rowwise(s), f_(f), heads_(heads), scale_(scale), softcap_(softcap) {}
  const char* name() const override { return "SlotinferAttendOut"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const AttendOut*>(&other);
    return o && o->f_ == f_ && o->heads_ == heads_ && o->scale_ == scale_ && o->softcap_ == softcap_;
  }

 protected:
  mx::Shape out_shape(const std::vector<mx::array>& in) const override { return in[3].shape(); }
  Fn body(const std::vector<mx::array>& in) const override {
    const int kvh = in[1].shape(1), D = in[0].shape(-1) / (heads_ + 2 * kvh);
    const bool q8 = in[1].dtype() == mx::uint8;
    AttendJob j = attend_job(in[0].shape(0), heads_, D, in[1], in[4], &in[5], scale_, softcap_);
    j.q_stride = in[0].shape(-1);
    const int hid = in[3].shape(-1);
    const Format f = f_;
    return [=](const std::vector<const float*>& fp, const std::vector<const void*>& o, float* out) mutable {
      // floats: qkv, [keys, values], x; others: [keys, values], tables, mask, w_o
      const int t = q8 ? 2 : 0;
      const float* x = fp[q8 ? 1 : 3];
      thread_local std::vector<float> att, y;
      att.resize((size_t)j.B * j.H * j.D);
      y.resize((size_t)j.B * hid);
      j.q = fp[0];
      j.keys = q8 ? nullptr : fp[1];
      j.values = q8 ? nullptr : fp[2];
      j.keys8 = q8 ? static_cast<const uint8_t*>(o[0]) : nullptr;
      j.values8 = q8 ? static_cast<const uint8_t*>(o[1]) : nullptr;
      j.tables = static_cast<const int32_t*>(o[t]);
      j.mask = static_cast<const bool*>(o[t + 1]);
      j.out = att.data();
      attend_pooled(j);
      run(f, att.data(), static_cast<const uint8_t*>(o[t + 2]), y.data(), j.B, j.H * j.D, hid);
      const float* yp = y.data();
      pooled_rows(j.B, hid, [&](int64_t b0, int64_t b1) {
        for (int64_t i = b0 * hid; i < b1 * hid; ++i) out[i] = x[i] + yp[i];
      });
    };
  }

 private:
  Format f_;
  int heads_;
  float scale_, softcap_;
};

// h + down(act(gate_up(rms_norm(h) * w_norm))), act silu (0) or gelu_tanh (1) of gate times up.
class MlpBlock : public Rowwise {
 public:
  MlpBlock(mx::Stream s, Format fgu, Format fd, float eps, int gelu)
      : Rowwise(s), fgu_(fgu), fd_(fd), eps_(eps), gelu_(gelu) {}
  const char* name() const override { return "SlotinferMlpBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const MlpBlock*>(&other);
    return o && o->fgu_ == fgu_ && o->fd_ == fd_ && o->eps_ == eps_ && o->gelu_ == gelu_;
  }

 protected:
  mx::Shape out_shape(const std::vector<mx::array>& in) const override { return in[0].shape(); }
  Fn body(const std::vector<mx::array>& in) const override {
    int hid = in[0].shape(-1), n = in[2].shape(0) / 2;
    int64_t rows = in[0].size() / hid;
    auto fgu = fgu_, fd = fd_;
    float eps = eps_;
    int gelu = gelu_;
    return [=](const std::vector<const float*>& f, const std::vector<const void*>& w, float* out) {
      thread_local std::vector<float> xn, gu, a, d;
      xn.resize(rows * hid);
      gu.resize(rows * 2 * n);
      a.resize(rows * n);
      d.resize(rows * hid);
      float *xnp = xn.data(), *gup = gu.data(), *ap = a.data(), *dp = d.data();
      pooled_rows(rows, hid, [&](int64_t r0, int64_t r1) {
        rms_norm_rows(f[0] + r0 * hid, f[1], xnp + r0 * hid, r1 - r0, hid, eps);
      });
      run(fgu, xnp, static_cast<const uint8_t*>(w[0]), gup, (int)rows, hid, 2 * n);
      // the activations cost several times a float of the norms': 8 floats' worth a value
      pooled_rows(rows, 8L * n, [&](int64_t r0, int64_t r1) { gated_rows(gup + r0 * 2 * n, ap + r0 * n, r1 - r0, n, gelu); });
      run(fd, ap, static_cast<const uint8_t*>(w[1]), dp, (int)rows, n, hid);
      pooled_rows(rows, hid, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0 * hid; i < r1 * hid; ++i) out[i] = f[0][i] + dp[i];
      });
    };
  }

 private:
  Format fgu_, fd_;
  float eps_;
  int gelu_;
};

}  // namespace

mx::StreamOrDevice cpu_only(mx::StreamOrDevice s, const char* what) {
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument(std::string(what) + " runs on the CPU only");
  return stream;
}

void need_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + " must be float32");
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s) {
  need_f32(x, "x");
  if (x.ndim() < 1) throw std::invalid_argument("x must have at least one axis");
  std::vector<mx::array> in{x};
  if (w) {
    need_f32(*w, "weight");
    if (w->ndim() != 1 || w->shape(0) != x.shape(-1)) throw std::invalid_argument("weight must be [x.shape[-1]]");
    in.push_back(*w);
  }
  auto stream = mx::to_stream(cpu_only(s, "rms_norm"));
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps), std::move(in));
}

mx::array rope_apply(const mx::array& x, const mx::array& cos, const mx::array& sin, mx::StreamOrDevice s) {
  need_f32(x, "x");
  need_f32(cos, "cos");
  need_f32(sin, "sin");
  if (x.ndim() != 4 || x.shape(2) != 1) throw std::invalid_argument("x must be [B, heads, 1, D]");
  if (cos.ndim() != 4 || cos.shape() != sin.shape() || (cos.shape(0) != 1 && cos.shape(0) != x.shape(0)) ||
      cos.shape(1) != 1 || cos.shape(2) != 1 || 2 * cos.shape(3) > x.shape(3))
    throw std::invalid_argument("cos and sin must be [B or 1, 1, 1, half] with 2 * half <= D");
  auto stream = mx::to_stream(cpu_only(s, "rope_apply"));
  return mx::array(x.shape(), mx::float32, std::make_shared<RopeApply>(stream), {x, cos, sin});
}

// The pools, block tables and mask of attention over blocks for B rows of `heads` query heads of size D.
// Pools: float32, or q8_0 (uint8 rows of D / 32 * 34 bytes: a float16 scale and 32 int8 values a block).
void need_paged(const mx::array& keys, const mx::array& values, const mx::array& tables, const mx::array* mask, int B,
                int heads, int D) {
  const bool q8 = keys.dtype() == mx::uint8;
  if (q8) {
    if (values.dtype() != mx::uint8 || D % 32 != 0)
      throw std::invalid_argument("q8_0 pools (uint8) need uint8 values too and a head size that 32 divides");
  } else {
    need_f32(keys, "keys");
    need_f32(values, "values");
  }
  const int row = q8 ? q8_row_bytes(D) : D;
  if (keys.ndim() != 4 || keys.shape() != values.shape() || keys.shape(3) != row || heads % keys.shape(1) != 0)
    throw std::invalid_argument("keys and values must be [blocks, kv_heads, block_size, D] (q8_0: D / 32 * 34 "
                                "bytes), kv_heads dividing heads");
  if (tables.dtype() != mx::int32 || tables.ndim() != 2 || tables.shape(0) != B)
    throw std::invalid_argument("tables must be int32 [B, blocks]");
  size_t span = (size_t)tables.shape(1) * keys.shape(2);
  if (mask && (mask->dtype() != mx::bool_ || (size_t)mask->shape(-1) != span ||
               (mask->size() != span && mask->size() != span * B)))
    throw std::invalid_argument("mask must be bool with one row of the tables' span for every row, or one for all");
}

mx::array paged_decode_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                                 const mx::array& tables, const std::optional<mx::array>& mask, float scale,
                                 float softcap, mx::StreamOrDevice s) {
  need_f32(q, "q");
  if (q.ndim() != 4 || q.shape(2) != 1) throw std::invalid_argument("q must be [B, heads, 1, D]");
  need_paged(keys, values, tables, mask ? &*mask : nullptr, q.shape(0), q.shape(1), q.shape(3));
  std::vector<mx::array> in{q, keys, values, tables};
  if (mask) in.push_back(*mask);
  auto stream = mx::to_stream(cpu_only(s, "paged_decode_attention"));
  return mx::array(q.shape(), mx::float32, std::make_shared<PagedDecodeAttention>(stream, scale, softcap), std::move(in));
}

void need_blocks(const mx::array& w, int k, Format f, const char* what) {
  int bb = block_bytes(f), per = block_values(f);
  if (w.dtype() != mx::uint8 || w.ndim() != 2 || !w.flags().row_contiguous || k % per != 0 ||
      (size_t)w.shape(1) != row_bytes(f, k))
    throw std::invalid_argument(std::string(what) + " must be contiguous uint8 [n, " + std::to_string(k) + " / " +
                                std::to_string(per) + " * " + std::to_string(bb) + "] blocks");
}

mx::array qkv_rope(const mx::array& x, const mx::array& w_norm, float eps, const mx::array& w_qkv,
                   const std::string& fmt_qkv, const mx::array& cos, const mx::array& sin, int heads, int kv_heads,
                   const std::optional<mx::array>& qkv_bias, const std::optional<mx::array>& qk_norm,
                   mx::StreamOrDevice s) {
  for (auto* a : {&x, &w_norm, &cos, &sin}) need_f32(*a, "x, the norm weight and the rope tables");
  if (x.ndim() != 3 || x.shape(1) != 1) throw std::invalid_argument("x must be [B, 1, hidden]");
  int B = x.shape(0), hid = x.shape(2);
  if (w_norm.ndim() != 1 || w_norm.shape(0) != hid) throw std::invalid_argument("the norm weight must be [hidden]");
  Format f = parse_format(fmt_qkv);
  need_blocks(w_qkv, hid, f, "w_qkv");
  int groups = heads + 2 * kv_heads;
  if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0 || w_qkv.shape(0) % groups != 0)
    throw std::invalid_argument("w_qkv must have (heads + 2 kv_heads) D rows, kv_heads dividing heads");
  int D = w_qkv.shape(0) / groups, half = cos.shape(-1);
  if (cos.shape() != sin.shape() || 2 * half > D || (cos.size() != (size_t)half && cos.size() != (size_t)half * B))
    throw std::invalid_argument("cos and sin must hold one row of half <= D / 2 for every row, or one for all");
  std::vector<mx::array> in{x, w_norm, w_qkv, cos, sin};
  if (qkv_bias) {
    need_f32(*qkv_bias, "qkv_bias");
    if (qkv_bias->size() != (size_t)w_qkv.shape(0)) throw std::invalid_argument("qkv_bias must have w_qkv's rows");
    in.push_back(*qkv_bias);
  }
  if (qk_norm) {
    need_f32(*qk_norm, "qk_norm");
    if (qk_norm->size() != (size_t)(heads + kv_heads) * D)
      throw std::invalid_argument("qk_norm must be [heads + kv_heads, D]");
    in.push_back(*qk_norm);
  }
  auto stream = mx::to_stream(cpu_only(s, "qkv_rope"));
  return mx::array({B, 1, w_qkv.shape(0)}, mx::float32,
                   std::make_shared<QkvRope>(stream, f, eps, heads, kv_heads, (bool)qkv_bias, (bool)qk_norm),
                   std::move(in));
}

mx::array attend_out(const mx::array& qkv, const mx::array& keys, const mx::array& values, const mx::array& tables,
                     const mx::array& mask, const mx::array& w_o, const std::string& fmt_o, const mx::array& x,
                     int heads, float scale, float softcap, mx::StreamOrDevice s) {
  for (auto* a : {&qkv, &x}) need_f32(*a, "qkv and x");
  if (x.ndim() != 3 || x.shape(1) != 1) throw std::invalid_argument("x must be [B, 1, hidden]");
  int B = x.shape(0), hid = x.shape(2);
  if (keys.ndim() != 4) throw std::invalid_argument("keys must be [blocks, kv_heads, block_size, D]");
  int kvh = keys.shape(1);
  if (qkv.ndim() != 3 || heads < 1 || qkv.shape(2) % (heads + 2 * kvh) != 0)
    throw std::invalid_argument("qkv must be [B, 1, (heads + 2 kv_heads) D]");
  int D = qkv.shape(2) / (heads + 2 * kvh);
  need_paged(keys, values, tables, &mask, B, heads, D);
  if (qkv.ndim() != 3 || qkv.shape(0) != B || qkv.shape(1) != 1 || qkv.shape(2) != (heads + 2 * kvh) * D)
    throw std::invalid_argument("qkv must be [B, 1, (heads + 2 kv_heads) D]");
  Format f = parse_format(fmt_o);
  need_blocks(w_o, heads * D, f, "w_o");
  if (w_o.shape(0) != hid) throw std::invalid_argument("w_o must have hidden rows");
  auto stream = mx::to_stream(cpu_only(s, "attend_out"));
  return mx::array(x.shape(), mx::float32, std::make_shared<AttendOut>(stream, f, heads, scale, softcap),
                   {qkv, keys, values, x, tables, mask, w_o});
}

mx::array mlp_block(const mx::array& h, const mx::array& w_norm, float eps, const mx::array& w_gate_up,
                    const std::string& fmt_gate_up, const mx::array& w_down, const std::string& fmt_down,
                    const std::string& activation, mx::StreamOrDevice s) {
  need_f32(h, "h");
  need_f32(w_norm, "the norm weight");
  if (h.ndim() < 1) throw std::invalid_argument("h must have at least one axis");
  int hid = h.shape(-1);
  if (w_norm.ndim() != 1 || w_norm.shape(0) != hid) throw std::invalid_argument("the norm weight must be [hidden]");
  Format fgu = parse_format(fmt_gate_up), fd = parse_format(fmt_down);
  need_blocks(w_gate_up, hid, fgu, "w_gate_up");
  int n = w_gate_up.shape(0) / 2;
  if (w_gate_up.shape(0) % 2 != 0) throw std::invalid_argument("w_gate_up must have an even number of rows");
  need_blocks(w_down, n, fd, "w_down");
  if (w_down.shape(0) != hid) throw std::invalid_argument("w_down must have hidden rows");
  if (activation != "silu" && activation != "gelu_tanh")
    throw std::invalid_argument("activation must be silu or gelu_tanh, got " + activation);
  auto stream = mx::to_stream(cpu_only(s, "mlp_block"));
  return mx::array(h.shape(), mx::float32,
                   std::make_shared<MlpBlock>(stream, fgu, fd, eps, activation == "gelu_tanh" ? 1 : 0),
                   {h, w_norm, w_gate_up, w_down});
}

mx::array qlinear(const mx::array& x, const mx::array& w, const std::string& format, bool spare,
                  mx::StreamOrDevice s) {
  Format f = parse_format(format);
  if (x.dtype() != mx::float32) throw std::invalid_argument("x must be float32");
  if (w.dtype() != mx::uint8 || w.ndim() != 2) throw std::invalid_argument("w must be a 2-D uint8 array of blocks");
  if (x.ndim() < 1) throw std::invalid_argument("x must have at least one axis");
  int k = x.shape(-1);
  int bb = block_bytes(f), per = block_values(f);
  if (k % per != 0 || (size_t)w.shape(1) != row_bytes(f, k))
    throw std::invalid_argument("w's rows must hold x.shape[-1] / " + std::to_string(per) + " blocks of " +
                                std::to_string(bb) + " bytes");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("qlinear runs on the CPU only");
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<QuantizedLinear>(stream, f, spare), {x, w});
}

}  // namespace qk
