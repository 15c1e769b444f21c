// The prefill attention primitive (prefill_attention.h says what it computes and why a query's
// output is the same in any call): the node, the function that checks its inputs, and the work
// items shared over the kernel pool.  The loops are in prefill_loops.h, once per instruction set.
#include "prefill_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_ops.h"
#include "pool.h"
#include "primitives.h"
#include "rowwise.h"
#include "simd.h"

namespace qk {

struct PrefillJob {
  const float* q;       // [B, H, L, D]
  const float* keys;    // [B, kvh, S, D]
  const float* values;
  const uint8_t* keys8;  // or [B, kvh, S, D / 32 * 34] in q8_0 blocks (then keys, values are null)
  const uint8_t* values8;
  const bool* mask;     // [Bm, L, S] or nullptr
  const int* first;     // [Bm, L]: each query's first visible key
  const int* last;      // [Bm, L]: one past its last visible key
  const uint8_t* gaps;  // [Bm, L]: whether the mask hides keys between them (else it is not read)
  float* out;           // [B, H, L, D]
  int B, H, kvh, L, S, D, Bm;
  float scale, softcap;
  int mrow(int b) const { return Bm == 1 ? 0 : b; }
};

struct PrefillScratch {
  std::vector<float> qs, o, m, l, a, kt, s, row, vd;
};

QK_INL Portable::V splat(Portable, float x) {
  Portable::V v;
  for (int i = 0; i < 8; ++i) v.l[i] = x;
  return v;
}
#ifdef QK_X86
QK_AVX2_TARGET QK_INL __m256 splat(Avx2, float x) { return _mm256_set1_ps(x); }
QK_AVX512_TARGET QK_INL __m512 splat(Avx512, float x) { return _mm512_set1_ps(x); }
#endif

template <class I>
struct PrefillKernels;

#define QK_ISA Portable
#define QK_TARGET QK_PORTABLE_TARGET
#include "prefill_loops.h"
#undef QK_ISA
#undef QK_TARGET

#ifdef QK_X86
#define QK_ISA Avx2
#define QK_TARGET QK_AVX2_TARGET
#include "prefill_loops.h"
#undef QK_ISA
#undef QK_TARGET

#define QK_ISA Avx512
#define QK_TARGET QK_AVX512_TARGET
#include "prefill_loops.h"
#undef QK_ISA
#undef QK_TARGET
#endif

namespace {

void prefill_item(const PrefillJob& j, int b, int g, int a0, int a1, PrefillScratch& sc) {
  switch (isa()) {
#ifdef QK_X86
    case Isa::Avx512: return PrefillKernels<Avx512>::item(j, b, g, a0, a1, sc);
    case Isa::Avx2: return PrefillKernels<Avx2>::item(j, b, g, a0, a1, sc);
#endif
    default: return PrefillKernels<Portable>::item(j, b, g, a0, a1, sc);
  }
}

// Each query's first visible key and one past its last, from the mask (or the causal rule), and
// whether the mask hides keys between them: where it does not (causal and window masks), the
// loops need not read it.
void reach(const PrefillJob& j, bool causal, std::vector<int>& first, std::vector<int>& last,
           std::vector<uint8_t>& gaps) {
  first.assign((size_t)j.Bm * j.L, 0);
  last.assign((size_t)j.Bm * j.L, j.S);
  gaps.assign((size_t)j.Bm * j.L, 0);
  for (int b = 0; b < j.Bm; ++b)
    for (int i = 0; i < j.L; ++i) {
      const size_t at = (size_t)b * j.L + i;
      if (j.mask) {
        const bool* m = j.mask + at * j.S;
        int f = 0, e = j.S;
        while (f < j.S && !m[f]) ++f;
        while (e > f && !m[e - 1]) --e;
        first[at] = f;
        last[at] = e;
        for (int x = f; x < e; ++x) gaps[at] |= !m[x];
      } else if (causal) {
        last[at] = std::max(0, std::min(j.S, i + j.S - j.L + 1));
      }
    }
}

// Queries per tile: about 128 query vectors (the group's heads times positions), so a tile's queries,
// scores and sums stay in the L2 cache while each block of K/V is read once for all of them.
int tile_positions(int rep, int L) { return std::max(1, std::min(L, 128 / std::max(rep, 1))); }

void run_prefill(PrefillJob j, bool causal) {
  std::vector<int> first, last;
  std::vector<uint8_t> gaps;
  reach(j, causal, first, last, gaps);
  j.first = first.data();
  j.last = last.data();
  j.gaps = gaps.data();
  const int rep = j.H / j.kvh, T = tile_positions(rep, j.L), tiles = (j.L + T - 1) / T;
  const int per_tile = j.B * j.kvh, items = tiles * per_tile;
  // the last tiles reach the most keys: handed out first, so the threads end together
  std::atomic<int> next{0};
  int threads = std::max(1, std::min(g_threads, items));
  if ((long)j.L * j.S * j.H * j.D * j.B < 1L << 20) threads = 1;
  std::function<void(int)> share = [&](int) {
    thread_local PrefillScratch sc;
    for (int it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int t = tiles - 1 - it / per_tile, bg = it % per_tile;
      prefill_item(j, bg / j.kvh, bg % j.kvh, t * T, std::min(j.L, (t + 1) * T), sc);
    }
  };
  g_pool->run(threads, share);
}

class PrefillAttention : public Rowwise {
 public:
  PrefillAttention(mx::Stream s, float scale, float softcap, bool causal)
      : Rowwise(s), scale_(scale), softcap_(softcap), causal_(causal) {}
  const char* name() const override { return "SlotinferPrefillAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PrefillAttention*>(&other);
    return o && o->scale_ == scale_ && o->softcap_ == softcap_ && o->causal_ == causal_;
  }

 protected:
  // inputs: q [B, H, L, D], keys, values [B, kvh, S, D] (float32, or q8_0 rows: uint8), optionally
  // mask bool [B or 1, L, S]
  mx::Shape out_shape(const std::vector<mx::array>& in) const override { return in[0].shape(); }
  Fn body(const std::vector<mx::array>& in) const override {
    PrefillJob j{};
    j.B = in[0].shape(0);
    j.H = in[0].shape(1);
    j.L = in[0].shape(2);
    j.D = in[0].shape(3);
    j.kvh = in[1].shape(1);
    j.S = in[1].shape(2);
    j.Bm = in.size() > 3 ? in[3].shape(0) : 1;
    j.scale = scale_;
    j.softcap = softcap_;
    const bool masked = in.size() > 3, causal = causal_, q8 = in[1].dtype() == mx::uint8;
    return [=](const std::vector<const float*>& f, const std::vector<const void*>& o, float* out) mutable {
      // floats: q, [keys, values]; others: [keys, values], mask
      j.q = f[0];
      j.keys = q8 ? nullptr : f[1];
      j.values = q8 ? nullptr : f[2];
      j.keys8 = q8 ? static_cast<const uint8_t*>(o[0]) : nullptr;
      j.values8 = q8 ? static_cast<const uint8_t*>(o[1]) : nullptr;
      j.mask = masked ? static_cast<const bool*>(o[q8 ? 2 : 0]) : nullptr;
      j.out = out;
      run_prefill(j, causal);
    };
  }

 private:
  float scale_, softcap_;
  bool causal_;
};

}  // namespace

mx::array prefill_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                            const std::optional<mx::array>& mask, float scale, float softcap, bool causal,
                            mx::StreamOrDevice s) {
  const bool q8 = keys.dtype() == mx::uint8;
  if (q.dtype() != mx::float32 || keys.dtype() != values.dtype() || (!q8 && keys.dtype() != mx::float32))
    throw std::invalid_argument("q must be float32, keys and values both float32 or both q8_0 (uint8)");
  if (q.ndim() != 4 || keys.ndim() != 4 || keys.shape() != values.shape())
    throw std::invalid_argument("q must be [B, heads, L, D], keys and values [B, kv_heads, S, D]");
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3), S = keys.shape(2);
  if (q8 && D % 32 != 0) throw std::invalid_argument("q8_0 keys and values need a head size that 32 divides");
  if (keys.shape(0) != B || keys.shape(3) != (q8 ? q8_row_bytes(D) : D) || keys.shape(1) < 1 || H % keys.shape(1) != 0)
    throw std::invalid_argument("keys must be [B, kv_heads, S, D] (q8_0: D / 32 * 34 bytes) with kv_heads dividing "
                                "q's heads");
  if (D < 1) throw std::invalid_argument("the head size must be at least 1");
  std::vector<mx::array> in{q, keys, values};
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->ndim() != 3 || (mask->shape(0) != 1 && mask->shape(0) != B) ||
        mask->shape(1) != L || mask->shape(2) != S)
      throw std::invalid_argument("mask must be bool [B or 1, L, S]");
    if (causal) throw std::invalid_argument("give a mask or causal, not both");
    in.push_back(*mask);
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("prefill_attention runs on the CPU only");
  return mx::array(q.shape(), mx::float32, std::make_shared<PrefillAttention>(stream, scale, softcap, causal),
                   std::move(in));
}

}  // namespace qk
