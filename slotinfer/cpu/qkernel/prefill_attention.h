// A prefill's causal attention as one MLX node: the queries of a chunk against the row's keys, in
// the manner of flash attention (a tile of queries meets the keys a block at a time, with a running
// max and sum per query), so nothing of size queries x keys is kept and each block of K/V is read
// once for a whole tile of queries.
//
// Exactness: a query's output depends on its own scores alone, whatever tile, call or batch it is
// computed in, and however its prompt was cut into chunks.  Keys go in blocks of KEY_BLOCK positions
// counted from position 0, in block order; within a block, the query's scores (a multiply-add chain
// over head_dim), their max, e = exp(s - running max) and the block's weighted sum of values (a chain
// over the block's keys in order) are computed for each query alone.  A block a query sees nothing
// of leaves its max, sum and output as they were, bit for bit (its weights are exact zeros and the
// rescaling factor exp(0) is exactly 1; before the query's first visible key nothing is computed at
// all), so the blocks a tile reads beyond what one query needs do not change that query.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace qk {

namespace mx = mlx::core;

inline constexpr int KEY_BLOCK = 64;  // keys per block of the running softmax: fixed, counted from 0

// q [B, H, L, D], keys and values [B, kv_heads, S, D] (grouped-query heads), float32.  mask: None (every key, or with `causal` key j seen by query i when j <= i + S - L) or
// bool [B or 1, L, S].  Scores are (q * scale) . k, soft-capped where softcap > 0.  A query that sees
// no key gets zeros.  Returns [B, H, L, D].
mx::array prefill_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                            const std::optional<mx::array>& mask, float scale, float softcap, bool causal,
                            mx::StreamOrDevice s);

}  // namespace qk
