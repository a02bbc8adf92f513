// One decode step of attention by positions in one call: each row's single query against its cached keys, keys
// allowed by their positions (real, not after the query when causal, inside the window), query heads of one KV
// head folded into rows (grouped-query attention reads each KV head once), learnable sinks (GPT-OSS) applied after
// the fact from the log-sum-exp: out * sigmoid(L - z[h]), the softmax share the sink leaves the keys. The torch
// ops of qkv/backends/sdpa.py's path for such a step, from C++; the attention itself is torch's CPU flash kernel.
#include <ATen/ATen.h>

#include <ATen/Dispatch.h>

#include <algorithm>
#include <limits>
#include <tuple>

// q (B, Hq, 1, D); k, v (B, Hkv, S, D); q_pos (B or 1, 1), kv_pos (B or 1, S) int64 (-1: padding or empty);
// window <= 0: none; sinks (Hq,) or None -> (B, Hq, 1, D).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                            const at::Tensor& kv_pos, bool causal, int64_t window,
                            const c10::optional<at::Tensor>& sinks, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 && q.size(1) % k.size(1) == 0 &&
                  v.size(-1) == q.size(-1) && q_pos.dim() == 2 && kv_pos.dim() == 2,
              "decode_attention: q (B, Hq, 1, D), k and v (B, Hkv, S, D), positions (B, 1) and (B, S)");
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(3), S = k.size(2);
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && kv_pos.scalar_type() == at::kLong && q_pos.size(1) == 1 &&
                  kv_pos.size(1) == S && (q_pos.size(0) == 1 || q_pos.size(0) == B) &&
                  (kv_pos.size(0) == 1 || kv_pos.size(0) == B),
              "decode_attention: int64 positions (B or 1, 1) and (B or 1, S)");
  // The additive mask: 0 where key s may be read by row b's query, -inf elsewhere (padding on either side, a key
  // after the query when causal, one at or beyond the window).
  const int64_t rows = std::max(q_pos.size(0), kv_pos.size(0));
  auto qp = q_pos.contiguous(), kp = kv_pos.contiguous();
  auto bias = at::empty({rows, 1, 1, S}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode_attention_mask", [&] {
    const int64_t* pq = qp.data_ptr<int64_t>();
    const int64_t* pk = kp.data_ptr<int64_t>();
    scalar_t* pb = bias.data_ptr<scalar_t>();
    const scalar_t blocked = -std::numeric_limits<scalar_t>::infinity();
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t at = pq[qp.size(0) == 1 ? 0 : b];
      const int64_t* keys = pk + (kp.size(0) == 1 ? 0 : b) * S;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t p = keys[s];
        const bool ok = p >= 0 && at >= 0 && (!causal || p <= at) && (window <= 0 || at - p < window);
        pb[b * S + s] = ok ? scalar_t(0) : blocked;
      }
    }
  });
  const int64_t g = Hq / Hkv;
  auto folded = q.reshape({B, Hkv, g, D});
  auto res = at::_scaled_dot_product_flash_attention_for_cpu(folded, k, v, 0.0, false, bias, scale);
  auto out = std::get<0>(res);
  if (sinks.has_value() && sinks->defined()) {
    auto lse = std::get<1>(res);  // (B, Hkv, g)
    out = out * at::sigmoid(lse - sinks->to(lse.scalar_type()).view({1, Hkv, g})).unsqueeze(-1);
  }
  return out.reshape({B, Hq, 1, D});
}
