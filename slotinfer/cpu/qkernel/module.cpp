// The Python module: slotinfer.cpu.qkernel._qkernel, binding the primitives' functions and the
// settings of the threads and loops.
#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "pool.h"
#include "prefill_attention.h"
#include "primitives.h"
#include "kernels_i8.h"
#include "qkernels.h"

#ifndef QK_MLX_VERSION
#define QK_MLX_VERSION "unknown"
#endif

namespace nb = nanobind;
using namespace nb::literals;
using namespace qk;

NB_MODULE(_qkernel, m) {
  m.doc() = "slotinfer's quantized linear layer on CPU (GGUF Q8_0 / Q4_0 / Q4_1 blocks)";
  m.def("qlinear", &qlinear, "x"_a, "w"_a, "format"_a, nb::kw_only(), "spare"_a = true, "stream"_a = nb::none(),
        "x @ dequant(w).T for w [n, k/32 blocks] in GGUF blocks (q8_0, q4_0, q4_1, q5_0, q4_k, q6_k); float32 "
        "out.  spare: at a few rows (set_spare_rows) leave a core to the other threads");
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a.none(), "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x * (1 / sqrt(mean(x^2) + eps)) * weight over the last axis, float32 (weight may be None)");
  m.def("rope_apply", &rope_apply, "x"_a, "cos"_a, "sin"_a, nb::kw_only(), "stream"_a = nb::none(),
        "rope of x [B, heads, 1, D] from tables cos, sin [B or 1, 1, 1, half]");
  m.def("paged_decode_attention", &paged_decode_attention, "q"_a, "keys"_a, "values"_a, "tables"_a, "mask"_a.none(),
        "scale"_a, "softcap"_a = 0.0f, nb::kw_only(), "stream"_a = nb::none(),
        "softmax attention of q [B, heads, 1, D] (times scale) over the blocks tables [B, n] of pools "
        "[blocks, kv_heads, block_size, D]; mask: bool [B or 1, ..., n * block_size] or None");
  m.def("prefill_attention", &prefill_attention, "q"_a, "keys"_a, "values"_a, "mask"_a.none(), "scale"_a,
        "softcap"_a = 0.0f, "causal"_a = false, nb::kw_only(), "stream"_a = nb::none(),
        "causal softmax attention of a prefill's q [B, heads, L, D] (times scale) over keys, values "
        "[B, kv_heads, S, D]; mask: bool [B or 1, L, S], or None with causal (key j seen by query i when "
        "j <= i + S - L) or without (every key)");
  m.def("qkv_rope", &qkv_rope, "x"_a, "w_norm"_a, "eps"_a, "w_qkv"_a, "fmt_qkv"_a, "cos"_a, "sin"_a, "heads"_a,
        "kv_heads"_a, nb::kw_only(), "qkv_bias"_a.none() = nb::none(), "qk_norm"_a.none() = nb::none(),
        "stream"_a = nb::none(),
        "rope(qk_norm(qkv(rms_norm(x) * w_norm) + qkv_bias)) of x [B, 1, hidden]: [B, 1, (heads + 2 kv_heads) D], "
        "queries and keys rotated by the tables cos, sin [B or 1, half]");
  m.def("attend_out", &attend_out, "qkv"_a, "keys"_a, "values"_a, "tables"_a, "mask"_a, "w_o"_a, "fmt_o"_a, "x"_a,
        "heads"_a, "scale"_a, "softcap"_a = 0.0f, nb::kw_only(), "stream"_a = nb::none(),
        "x + o(attention of qkv's queries over the blocks tables [B, n] of the pools, under mask)");
  m.def("kv_write", &kv_write, "pool"_a, "qkv"_a, "index"_a, "heads"_a, "part"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "the float32 pool [blocks, kv_heads, block_size, D] with the K (part 0) or V (part 1) of qkv "
        "[B, 1, (heads + 2 kv_heads) D] written at index (flat offsets, [B * kv_heads * D]); in place where "
        "nothing else holds the pool");
  m.def("mlp_block", &mlp_block, "h"_a, "w_norm"_a, "eps"_a, "w_gate_up"_a, "fmt_gate_up"_a, "w_down"_a, "fmt_down"_a,
        "activation"_a = "silu", nb::kw_only(), "stream"_a = nb::none(),
        "h + down(act(gate) * up) of rms_norm(h) * w_norm, gate | up from w_gate_up (act: silu or gelu_tanh)");
  m.attr("mlx_version") = QK_MLX_VERSION;  // the mlx whose headers and library it was built against
  m.def("block_bytes", [](const std::string& f) { return block_bytes(parse_format(f)); });
  m.def("block_values", [](const std::string& f) { return block_values(parse_format(f)); });
  m.def("set_threads", [](int t) { g_threads = std::max(1, t); }, "threads"_a);
  m.def("threads", []() { return g_threads; });
  m.def("set_spare_rows", [](int rows) { g_spare_rows = rows; }, "rows"_a,
        "products of at most this many rows leave one core to the other threads (default 0: never)");
  m.def("set_spin_us", [](int us) { g_pool->spin_us = std::max(0, us); }, "microseconds"_a);
  m.def("set_int8_activations", [](bool on) { int8_activations() = on; }, "on"_a,
        "products quantize each row of x to int8 per block of 32 and multiply in integers (kernels_i8.h)");
  m.def("int8_activations", []() { return int8_activations(); });
  m.def("int8_kernels", []() { return std::string(int8_loops()); }, "the int8 loops in use (avx512vnni, avx2, portable)");
  m.def("kernels", []() { return std::string(isa_name(isa())); }, "the loops in use");
  m.def("best_kernels", []() { return std::string(isa_name(best_isa())); }, "the best loops this CPU runs");
  m.def(
      "set_kernels",
      [](const std::string& name) {
        for (Isa i : {Isa::Portable, Isa::Avx2, Isa::Avx512})
          if (name == isa_name(i)) {
            if ((int)i > (int)best_isa()) throw std::invalid_argument("this CPU cannot run " + name);
            isa() = i;
            return;
          }
        throw std::invalid_argument("kernels must be portable, avx2 or avx512, got " + name);
      },
      "name"_a, "use these loops (portable, avx2, avx512; up to what the CPU runs): for tests");
}
