// An MLX primitive for x @ dequant(W).T with W in GGUF blocks (Q8_0, Q4_0, Q4_1), CPU only,
// and its Python binding.  The loops are in qkernels.h.
#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qkernels.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace {

int g_threads = 0;  // 0: OpenMP's default

qk::Format parse_format(const std::string& name) {
  if (name == "q8_0") return qk::Format::Q8_0;
  if (name == "q4_0") return qk::Format::Q4_0;
  if (name == "q4_1") return qk::Format::Q4_1;
  throw std::invalid_argument("format must be q8_0, q4_0 or q4_1, got " + name);
}

// Split the columns over the threads in whole groups of 8 (a thread never splits a sum).
void run(qk::Format f, const float* x, const uint8_t* W, float* out, int m, int k, int n) {
  int threads = g_threads > 0 ? g_threads : omp_get_max_threads();
  int groups = (n + qk::GROUP - 1) / qk::GROUP;
  threads = std::max(1, std::min(threads, groups));
  std::vector<float> xp((size_t)m * k);
  for (int r0 = 0; r0 < m; r0 += qk::ROW_CHUNK)
    qk::pack_rows(x, k, r0, std::min(m, r0 + qk::ROW_CHUNK), xp.data() + (size_t)r0 * k);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int j0 = std::min(n, (int)((long)groups * t / T) * qk::GROUP);
    int j1 = std::min(n, (int)((long)groups * (t + 1) / T) * qk::GROUP);
    for (int r0 = 0; r0 < m && j0 < j1; r0 += qk::ROW_CHUNK)
      qk::columns(f, xp.data() + (size_t)r0 * k, W, out, k, n, r0, std::min(m, r0 + qk::ROW_CHUNK), j0, j1);
  }
}

class QuantizedLinear : public mx::Primitive {
 public:
  QuantizedLinear(mx::Stream s, qk::Format f) : mx::Primitive(s), format_(f) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_input_array(w);
    enc.set_output_array(out);
    int k = x.shape(-1), n = w.shape(0);
    int m = (int)(x.size() / std::max(k, 1));
    enc.dispatch([f = format_, xp = x.data<float>(), wp = w.data<uint8_t>(), op = out.data<float>(), m, k, n]() {
      run(f, xp, wp, op, m, k, n);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("QuantizedLinear has no GPU kernel: use mx.quantized_matmul there");
  }

  const char* name() const override { return "QuantizedLinear"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QuantizedLinear*>(&other);
    return o && o->format_ == format_;
  }

 private:
  qk::Format format_;
};

mx::array qlinear(const mx::array& x, const mx::array& w, const std::string& format, mx::StreamOrDevice s) {
  qk::Format f = parse_format(format);
  if (x.dtype() != mx::float32) throw std::invalid_argument("x must be float32");
  if (w.dtype() != mx::uint8 || w.ndim() != 2) throw std::invalid_argument("w must be a 2-D uint8 array of blocks");
  int k = x.shape(-1);
  int bb = qk::block_bytes(f);
  if (k % qk::BLOCK != 0 || w.shape(1) != (k / qk::BLOCK) * bb)
    throw std::invalid_argument("w's rows must hold x.shape[-1] / 32 blocks of " + std::to_string(bb) + " bytes");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("qlinear runs on the CPU only");
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<QuantizedLinear>(stream, f),
                   {mx::contiguous(x, false, stream), mx::contiguous(w, false, stream)});
}

}  // namespace

NB_MODULE(_qkernel, m) {
  m.doc() = "slotinfer's quantized linear layer on CPU (prototype)";
  m.def("qlinear", &qlinear, "x"_a, "w"_a, "format"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ dequant(w).T for w [n, k/32 blocks] in GGUF blocks (q8_0, q4_0, q4_1); float32 out");
  m.def("block_bytes", [](const std::string& f) { return qk::block_bytes(parse_format(f)); });
  m.def("set_threads", [](int t) { g_threads = t; }, "threads"_a);
  m.def("threads", []() { return g_threads > 0 ? g_threads : omp_get_max_threads(); });
  m.def("set_portable", [](bool p) { qk::portable_forced() = p; }, "portable"_a);
  m.def("kernels", []() {
#ifdef QK_X86
    if (qk::cpu_has_avx2() && !qk::portable_forced()) return std::string("avx2");
#endif
    return std::string("portable");
  });
}
