// The K/V writes of a fused decode block: the step's K or V, from q|k|v, written into a float32 pool in
// place (one node a pool), with the function that checks its inputs and builds its node.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "primitives.h"
#include "rowwise.h"

namespace qk {

namespace {

// A decode step's K (part 0) or V (part 1) of one layer, taken from q|k|v [B, 1, (heads + 2 kvh) D], written
// into the layer's float32 pool [blocks, kvh, bs, D] at `index` (flat element offsets, [B * kvh * D], in the
// order of a [B, kvh, 1, D] update): one node for what MLX's ops take six (a slice, three reshapes, the
// scatter and its reshape back).  The output is the pool written.  Like MLX's scatter, a pool nothing else
// holds is written in place (its buffer passed on to the output), one still held is copied first.  One
// node a pool, not one for both: a node's outputs keep each other referenced, so the next step could
// never be handed either pool in place.
class KvWrite : public mx::Primitive {
 public:
  KvWrite(mx::Stream s, int heads, int part) : mx::Primitive(s), heads_(heads), part_(part) {}
  const char* name() const override { return "SlotinferKvWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const KvWrite*>(&other);
    return o && o->heads_ == heads_ && o->part_ == part_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override { return {in[0].shape()}; }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("SlotinferKvWrite has no GPU kernel: MLX's own ops serve there");
  }

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    const bool copy = !(in[0].flags().row_contiguous && in[0].is_donatable());
    if (copy)
      out.set_data(mx::allocator::malloc(out.nbytes()));
    else
      out.copy_shared_buffer(in[0]);
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    const int kvh = in[0].shape(1), D = in[0].shape(3), B = in[1].shape(0);
    const int row = in[1].shape(-1), first = heads_ + part_ * kvh;
    const bool wide = in[2].dtype() == mx::int64;
    enc.dispatch([pool = Operand<float>(in[0]), qkv = Operand<float>(in[1]), index = Operand<uint8_t>(in[2]), copy,
                  dst = out.data<float>(), kvh, D, B, row, first, wide]() {
      thread_local std::vector<float> pbuf, qbuf;
      thread_local std::vector<uint8_t> ibuf;
      if (copy) std::memcpy(dst, pool.packed(pbuf), pool.size * sizeof(float));
      const float* q = qkv.packed(qbuf);
      const void* ix = index.packed_as(ibuf, wide ? 8 : 4);
      const int64_t size = (int64_t)pool.size;
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < kvh; ++h) {
          const float* src = q + (size_t)b * row + (size_t)(first + h) * D;
          const size_t at = ((size_t)b * kvh + h) * D;
          for (int d = 0; d < D; ++d) {
            int64_t o = wide ? static_cast<const int64_t*>(ix)[at + d] : static_cast<const int32_t*>(ix)[at + d];
            if (o >= 0 && o < size) dst[o] = src[d];
          }
        }
    });
  }

 private:
  int heads_, part_;
};

}  // namespace

mx::array kv_write(const mx::array& pool, const mx::array& qkv, const mx::array& index, int heads, int part,
                   mx::StreamOrDevice s) {
  need_f32(pool, "the pool");
  need_f32(qkv, "qkv");
  if (pool.ndim() != 4) throw std::invalid_argument("the pool must be float32 [blocks, kv_heads, block_size, D]");
  if (part != 0 && part != 1) throw std::invalid_argument("part must be 0 (K) or 1 (V)");
  const int kvh = pool.shape(1), D = pool.shape(3);
  if (heads < 1 || qkv.ndim() != 3 || qkv.shape(1) != 1 || qkv.shape(2) != (heads + 2 * kvh) * D)
    throw std::invalid_argument("qkv must be [B, 1, (heads + 2 kv_heads) D]");
  if ((index.dtype() != mx::int32 && index.dtype() != mx::int64) || index.ndim() != 1 ||
      index.shape(0) != qkv.shape(0) * kvh * D)
    throw std::invalid_argument("index must be int32 or int64 [B * kv_heads * D] (flat offsets into the pool)");
  auto stream = mx::to_stream(cpu_only(s, "kv_write"));
  return mx::array(pool.shape(), mx::float32, std::make_shared<KvWrite>(stream, heads, part), {pool, qkv, index});
}

}  // namespace qk
