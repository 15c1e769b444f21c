// What the Python module binds: functions that check their inputs and return the node of one of
// the primitives (primitives.cpp), and the settings of how a product is shared among threads.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "qkernels.h"

namespace qk {

namespace mx = mlx::core;

inline int g_threads = 1;
inline int g_spare_rows = 0;  // products of at most this many rows leave a core free (primitives.cpp, run); 0: none

Format parse_format(const std::string& name);
// The input checks the primitives' functions share: a stream on the CPU (else invalid_argument naming
// `what`), and a float32 array.
mx::StreamOrDevice cpu_only(mx::StreamOrDevice s, const char* what);
void need_f32(const mx::array& a, const char* what);

// spare: the product may leave a core to the other threads at a few rows (g_spare_rows, primitives.cpp's run)
mx::array qlinear(const mx::array& x, const mx::array& w, const std::string& format, bool spare, mx::StreamOrDevice s);
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s);
mx::array rope_apply(const mx::array& x, const mx::array& cos, const mx::array& sin, mx::StreamOrDevice s);
mx::array paged_decode_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                                 const mx::array& tables, const std::optional<mx::array>& mask, float scale,
                                 float softcap, mx::StreamOrDevice s);
mx::array qkv_rope(const mx::array& x, const mx::array& w_norm, float eps, const mx::array& w_qkv,
                   const std::string& fmt_qkv, const mx::array& cos, const mx::array& sin, int heads, int kv_heads,
                   const std::optional<mx::array>& qkv_bias, const std::optional<mx::array>& qk_norm,
                   mx::StreamOrDevice s);
mx::array attend_out(const mx::array& qkv, const mx::array& keys, const mx::array& values, const mx::array& tables,
                     const mx::array& mask, const mx::array& w_o, const std::string& fmt_o, const mx::array& x,
                     int heads, float scale, float softcap, mx::StreamOrDevice s);
// The step's K (part 0) or V (part 1) from qkv written into a float32 pool at index (flat offsets): the
// pool written, in place where nothing else holds it.
mx::array kv_write(const mx::array& pool, const mx::array& qkv, const mx::array& index, int heads, int part,
                   mx::StreamOrDevice s);
mx::array mlp_block(const mx::array& h, const mx::array& w_norm, float eps, const mx::array& w_gate_up,
                    const std::string& fmt_gate_up, const mx::array& w_down, const std::string& fmt_down,
                    const std::string& activation, mx::StreamOrDevice s);

}  // namespace qk
